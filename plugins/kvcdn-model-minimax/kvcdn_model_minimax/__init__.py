"""kvcdn model family: MiniMax-M2 (``MiniMaxM2ForCausalLM``).

MiniMax-M2 is a full-attention mixture of experts with QK norms and partial rotary embeddings.

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family minimax``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class MiniMaxAdapter(ModelAdapter):
    family = "minimax"
    architectures = ("MiniMaxM2ForCausalLM",)
    validation_configs = {
        "MiniMaxM2ForCausalLM": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2),
    }
    validation_variants = {
        "MiniMaxM2ForCausalLM": [dict(_variant="12q-kv2", num_attention_heads=12, num_key_value_heads=2, head_dim=8)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [MiniMaxAdapter]
