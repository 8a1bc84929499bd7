"""kvcdn model family: GLM, GLM-4, GLM-4.5 MoE and GLM-MoE-DSA (``GlmForCausalLM``,
``Glm4ForCausalLM``, ``Glm4MoeForCausalLM``, ``GlmMoeDsaForCausalLM``).

The first three use partial rotary embeddings (half of each head is rotated) and a standard
transformers ``DynamicCache`` of full-attention layers, so the base adapter does the export and
import; this plugin names the architectures and their tiny validation configs. GLM-MoE-DSA (GLM-5)
caches DeepSeek's MLA latent and sparse-attention indexer keys instead: :mod:`kvcdn_model_glm.dsa`.
The older ChatGLM checkpoints (``ChatGLMModel``, remote code) are a different architecture and are
not served.
"""

from kvcdn_core import ModelAdapter, TinyDecoderFamily, hookimpl
from kvcdn_model_glm.dsa import GlmDsaAdapter

__version__ = "0.1.0"
__all__ = ["GlmAdapter", "GlmDsaAdapter"]


class GlmAdapter(TinyDecoderFamily):
    family = "glm"
    tiny_changes = {
        "GlmForCausalLM": {},
        "Glm4ForCausalLM": {},
        # GLM-4.5: a dense first layer then routed + shared experts, QK norms, partial rotary.
        "Glm4MoeForCausalLM": dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            use_qk_norm=True,
        ),
    }
    validation_variants = {
        # GLM-4.5-Air's 96 query heads on 8 key-value heads (12:1), scaled down.
        "Glm4MoeForCausalLM": [dict(_variant="12q-kv1", num_attention_heads=12, num_key_value_heads=1, head_dim=8)],
        "GlmForCausalLM": [dict(_variant="mha-tied", num_key_value_heads=4, tie_word_embeddings=True)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[ModelAdapter]]:
    return [GlmAdapter, GlmDsaAdapter]
