"""kvcdn model family: LG AI EXAONE 4.0 (``Exaone4ForCausalLM``).

EXAONE 4.0 mixes sliding-window and global layers (hybrid attention) with QK norms; the global
layers have no rotary embedding.

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family exaone``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class ExaoneAdapter(ModelAdapter):
    family = "exaone"
    architectures = ("Exaone4ForCausalLM",)
    validation_configs = {
        "Exaone4ForCausalLM": dict(_COMMON, num_hidden_layers=4, sliding_window=16,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    }
    validation_variants = {
        "Exaone4ForCausalLM": [dict(_variant="8q-kv1-wide-heads", num_attention_heads=8, num_key_value_heads=1, head_dim=32)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [ExaoneAdapter]
