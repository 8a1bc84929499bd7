"""kvcdn model family: NVIDIA Nemotron (``NemotronForCausalLM``, Nemotron-3/4 and Minitron).

Nemotron is full attention with partial rotary embeddings, LayerNorm1p and a squared-ReLU MLP.

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family nemotron``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class NemotronAdapter(ModelAdapter):
    family = "nemotron"
    architectures = ("NemotronForCausalLM",)
    validation_configs = {
        "NemotronForCausalLM": dict(_COMMON, partial_rotary_factor=0.5),
    }
    validation_variants = {
        "NemotronForCausalLM": [dict(_variant="8q-kv1", num_attention_heads=8, num_key_value_heads=1)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [NemotronAdapter]
