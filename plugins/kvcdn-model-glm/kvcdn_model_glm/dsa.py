"""GLM-MoE-DSA (GLM-5): DeepSeek's multi-head latent attention with DeepSeek sparse attention.

The cache is DeepSeek-V3.2's: per layer the MLA latent and rotary key, plus the lightning indexer's
keys that pick each query's ``index_topk`` keys. GLM adds cross-layer top-k sharing: a ``"shared"``
layer (``config.indexer_types``) reuses the previous indexer layer's selection and caches no indexer
keys of its own, so its artifact entry is a plain ``mla_latent``. The export, import and refusals are
core's (:class:`kvcdn_core.MlaLayers`, shared with the deepseek family); this module names the
architecture and its tiny validation shapes.
"""

from __future__ import annotations

from kvcdn_core import TINY_DEEPSEEK_MOE, TINY_MLA, MlaLayers, ModelAdapter

_DSA = dict(
    TINY_MLA,
    **TINY_DEEPSEEK_MOE,
    num_hidden_layers=3,
    q_lora_rank=32,
    n_group=1,
    topk_group=1,
    # Each query attends to its 16 best-scored keys, far fewer than the validation context (96+
    # tokens), so the selection decides what the model sees; the middle layer reuses layer 0's. 16
    # indexer heads (GLM-5 has 32): with 4, exact ties at a score of 0 make transformers' own top-k
    # depend on the chunking (see kvcdn_model_deepseek).
    index_topk=16,
    index_head_dim=16,
    index_n_heads=16,
    indexer_types=["full", "shared", "full"],
)


class GlmDsaAdapter(MlaLayers, ModelAdapter):
    family = "glm"
    architectures = ("GlmMoeDsaForCausalLM",)
    validation_configs = {"GlmMoeDsaForCausalLM": _DSA}
    validation_variants = {
        "GlmMoeDsaForCausalLM": [
            # GLM-5's value head wider than its plain key head, grouped heads (8:2), two layers
            # sharing one selection, 8 keys selected by a wider indexer.
            dict(
                _variant="8q-kv2-top8",
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=2,
                v_head_dim=32,
                index_topk=8,
                index_head_dim=32,
                index_n_heads=32,
                indexer_types=["full", "shared", "shared", "full"],
            ),
            # Every layer runs its own indexer; tied embeddings, a narrower latent.
            dict(
                _variant="all-full-tied",
                num_hidden_layers=2,
                indexer_types=["full", "full"],
                kv_lora_rank=16,
                tie_word_embeddings=True,
            ),
        ],
    }
