"""kvcdn model family: Qwen2, Qwen3 and Qwen3-MoE.

These use the standard transformers ``DynamicCache`` (full attention, and sliding-window layers when
``use_sliding_window`` is set), so the base adapter does all the work; this plugin names the
architectures and their tiny validation configs.
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


class QwenAdapter(ModelAdapter):
    family = "qwen"
    architectures = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    validation_configs = {
        "Qwen2ForCausalLM": dict(_COMMON),
        "Qwen3ForCausalLM": dict(_COMMON, head_dim=16),
        "Qwen3MoeForCausalLM": dict(_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=64, decoder_sparse_step=1),
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [QwenAdapter]
