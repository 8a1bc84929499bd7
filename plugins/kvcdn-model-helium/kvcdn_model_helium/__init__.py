"""kvcdn model family: Kyutai Helium (``HeliumForCausalLM``).

Helium is a Llama-layout full-attention decoder.

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family helium``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class HeliumAdapter(ModelAdapter):
    family = "helium"
    architectures = ("HeliumForCausalLM",)
    validation_configs = {
        "HeliumForCausalLM": dict(_COMMON),
    }
    validation_variants = {
        "HeliumForCausalLM": [dict(_variant="mha", num_key_value_heads=4)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [HeliumAdapter]
