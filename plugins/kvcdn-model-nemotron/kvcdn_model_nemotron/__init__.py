"""kvcdn model family: NVIDIA Nemotron (``NemotronForCausalLM``, Nemotron-3/4 and Minitron).

Nemotron is full attention with partial rotary embeddings, LayerNorm1p and a squared-ReLU MLP.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family nemotron``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class NemotronAdapter(TinyDecoderFamily):
    family = "nemotron"
    tiny_changes = {
        "NemotronForCausalLM": dict(partial_rotary_factor=0.5),
    }
    validation_variants = {
        "NemotronForCausalLM": [dict(_variant="8q-kv1", num_attention_heads=8, num_key_value_heads=1)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[NemotronAdapter]]:
    return [NemotronAdapter]
