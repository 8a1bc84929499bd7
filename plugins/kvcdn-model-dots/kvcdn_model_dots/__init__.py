"""kvcdn model family: rednote dots.llm1 (``Dots1ForCausalLM``).

dots.llm1 is a DeepSeek-V3-style mixture of experts (a dense first layer, routed and shared experts)
over plain full attention with QK norms.

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family dots``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class DotsAdapter(ModelAdapter):
    family = "dots"
    architectures = ("Dots1ForCausalLM",)
    validation_configs = {
        "Dots1ForCausalLM": dict(_COMMON, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 n_shared_experts=1, first_k_dense_replace=1),
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [DotsAdapter]
