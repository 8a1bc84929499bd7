"""kvcdn model family: Baidu ERNIE 4.5 dense (``Ernie4_5ForCausalLM``).

ERNIE 4.5's dense models are full attention with interleaved rotary embeddings.

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family ernie``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class ErnieAdapter(ModelAdapter):
    family = "ernie"
    architectures = ("Ernie4_5ForCausalLM",)
    validation_configs = {
        "Ernie4_5ForCausalLM": dict(_COMMON),
    }
    validation_variants = {
        "Ernie4_5ForCausalLM": [dict(_variant="8q-kv2-tied", num_attention_heads=8, tie_word_embeddings=True)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [ErnieAdapter]
