"""kvcdn model family: attention + state-space / convolution hybrids (Jamba, Granite 4 hybrid, LFM2).

Jamba (Mamba + attention, AI21), Granite 4.0 hybrid (``GraniteMoeHybridForCausalLM``: Mamba2 +
attention, IBM) and LFM2 / LFM2-MoE (short gated convolutions + attention, Liquid AI) keep, in
transformers 5.24, one cache layer per decoder layer: a ``DynamicLayer`` of keys and values for the
attention layers and a pure linear-attention layer (convolution state, plus an SSM state for Mamba)
for the others. Those states summarise the whole prefix: the artifact records them as
``linear_attention`` and is reusable only as the whole prefix (cropping is refused). transformers'
mixers take the saved state as their initial state on multi-token input, so chunked prefill and a
multi-token question on a restored cache are exact (checked by ``kvcdn validate``).

Hybrids whose layers hold both a state and keys/values in one cache layer (Zamba2, Falcon-H1) and
those whose restored state does not continue exactly (Bamba) are not claimed; see
docs/model-families-hybrid-ssm.md.
"""

from kvcdn_core import TINY_DECODER, LinearAttentionLayers, ModelAdapter, hookimpl

__version__ = "0.1.0"

_COMMON = dict(TINY_DECODER, num_hidden_layers=4)
_MAMBA2 = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=32,
)
_LFM2_LAYERS = ["conv", "full_attention", "conv", "full_attention"]


class HybridAdapter(LinearAttentionLayers, ModelAdapter):
    family = "hybrid"
    architectures = ("JambaForCausalLM", "GraniteMoeHybridForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
    validation_configs = {
        # Mamba on even layers, attention on odd ones, experts every other layer.
        "JambaForCausalLM": dict(
            _COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        ),
        "GraniteMoeHybridForCausalLM": dict(
            _COMMON,
            **_MAMBA2,
            layer_types=["mamba", "attention"] * 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
        ),
        "Lfm2ForCausalLM": dict(_COMMON, layer_types=_LFM2_LAYERS),
        "Lfm2MoeForCausalLM": dict(
            _COMMON,
            layer_types=_LFM2_LAYERS,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_dense_layers=1,
        ),
    }
    validation_variants = {
        "Lfm2ForCausalLM": [dict(_variant="8q-kv2-tied", num_attention_heads=8, head_dim=8, tie_word_embeddings=True)],
        "GraniteMoeHybridForCausalLM": [
            dict(_variant="mamba-mamba-attn", num_hidden_layers=3, layer_types=["mamba", "mamba", "attention"])
        ],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [HybridAdapter]
