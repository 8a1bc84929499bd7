"""kvcdn model family: Qwen2, Qwen3, Qwen3-MoE and Qwen3-Next.

Qwen2/Qwen3/Qwen3-MoE use the standard transformers ``DynamicCache`` (full attention, and
sliding-window layers when ``use_sliding_window`` is set), so the base adapter does all the work.
Qwen3-Next adds linear-attention layers (see :mod:`kvcdn_model_qwen.qwen3_next`).
"""

from kvcdn_core import hookimpl
from kvcdn_core import ModelAdapter
from kvcdn_model_qwen.qwen3_next import QWEN3_NEXT_CONFIG, LinearAttentionLayers

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


class QwenAdapter(LinearAttentionLayers, ModelAdapter):
    family = "qwen"
    architectures = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
    validation_configs = {
        "Qwen2ForCausalLM": dict(_COMMON),
        "Qwen3ForCausalLM": dict(_COMMON, head_dim=16),
        "Qwen3MoeForCausalLM": dict(_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=64, decoder_sparse_step=1),
        "Qwen3NextForCausalLM": dict(QWEN3_NEXT_CONFIG),
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [QwenAdapter]
