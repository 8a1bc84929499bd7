"""kvcdn model family: Baidu ERNIE 4.5 dense (``Ernie4_5ForCausalLM``).

ERNIE 4.5's dense models are full attention with interleaved rotary embeddings.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family ernie``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class ErnieAdapter(TinyDecoderFamily):
    family = "ernie"
    tiny_changes = {
        "Ernie4_5ForCausalLM": {},
    }
    validation_variants = {
        "Ernie4_5ForCausalLM": [dict(_variant="8q-kv2-tied", num_attention_heads=8, tie_word_embeddings=True)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[ErnieAdapter]]:
    return [ErnieAdapter]
