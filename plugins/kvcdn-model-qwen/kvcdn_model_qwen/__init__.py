"""kvcdn model family: Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE.

Qwen2/Qwen2-MoE/Qwen3/Qwen3-MoE use the standard transformers ``DynamicCache`` (full attention, and
sliding-window layers when ``use_sliding_window`` is set), so the base adapter does all the work.
Qwen3-Next and Qwen3.5 (dense and MoE, the text models) add gated-DeltaNet linear-attention layers
(see :mod:`kvcdn_model_qwen.qwen3_next`); their artifacts are reusable as a whole prefix only.
"""

from kvcdn_core import LinearAttentionLayers, TinyDecoderFamily, hookimpl
from kvcdn_model_qwen.qwen3_next import QWEN3_5_CONFIG, QWEN3_NEXT_CONFIG

__version__ = "0.1.0"


class QwenAdapter(LinearAttentionLayers, TinyDecoderFamily):
    family = "qwen"
    architectures = (
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
    )
    tiny_changes = {
        "Qwen2ForCausalLM": {},
        "Qwen3ForCausalLM": {},
        "Qwen3MoeForCausalLM": dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1
        ),
        "Qwen3NextForCausalLM": dict(QWEN3_NEXT_CONFIG),
        "Qwen2MoeForCausalLM": dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
        ),
        # Alternating here: with three random linear layers before the only global one, the tiny
        # dense model's output stops depending on the context (the MoE variant keeps the 3:1 pattern).
        "Qwen3_5ForCausalLM": dict(QWEN3_5_CONFIG, layer_types=["linear_attention", "full_attention"] * 2),
        "Qwen3_5MoeForCausalLM": dict(
            QWEN3_5_CONFIG,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    }
    validation_variants = {
        # Qwen2.5-7B's 7:1 GQA ratio; Qwen2.5-0.5B's tied embeddings with 14:2 heads.
        "Qwen2ForCausalLM": [
            dict(
                _variant="8q-kv1-tied",
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=8,
                tie_word_embeddings=True,
            ),
            dict(
                _variant="yarn",
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1e6,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ],
        # Qwen3's head_dim is independent of hidden/heads (128 with hidden 1024 and 16 heads).
        "Qwen3ForCausalLM": [
            dict(_variant="8q-kv4-wide-heads", num_attention_heads=8, num_key_value_heads=4, head_dim=32)
        ],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[QwenAdapter]]:
    return [QwenAdapter]
