"""kvcdn model family: attention + state-space / convolution hybrids.

Jamba (Mamba + attention, AI21), Granite 4.0 hybrid (``GraniteMoeHybridForCausalLM``: Mamba2 +
attention, IBM), Bamba (Mamba2 + attention, IBM) and LFM2 / LFM2-MoE (short gated convolutions +
attention, Liquid AI) keep, in transformers 5.24, one cache layer per decoder layer: a
``DynamicLayer`` of keys and values for the attention layers and a pure linear-attention layer
(convolution state, plus an SSM state for Mamba) for the others, recorded as ``linear_attention``.
Falcon-H1 (Mamba2 and attention side by side in every layer, TII), Zamba (Mamba + one shared
attention block, Zyphra) and Zamba2 (Mamba2 + shared blocks) also have layers holding a state and
keys/values at once (:mod:`kvcdn_model_hybrid.state_and_attention`, ``linear_and_full_attention``).
States summarise the whole prefix: these artifacts are reusable only as the whole prefix (cropping is
refused).

Continuing exactly needs two things transformers' own forward does not do on every model: explicit
position ids (:mod:`kvcdn_model_hybrid.positions`, for Bamba) and a Mamba scan seeded with the cached
state on multi-token input (:mod:`kvcdn_model_hybrid.seeded`, for Jamba and Zamba). Checked by
``kvcdn validate`` against a full prefill; see docs/model-families-hybrid-ssm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcdn_core import TINY_DECODER, LinearAttentionLayers, ModelAdapter, hookimpl
from kvcdn_model_hybrid import seeded
from kvcdn_model_hybrid.positions import position_kwargs
from kvcdn_model_hybrid.state_and_attention import StateAndAttentionLayers

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

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


#: Falcon-H1's Mamba2 mixer beside attention in every layer (``mamba_d_ssm`` = 8 heads x 16).
_FALCON_H1 = dict(TINY_DECODER, **_MAMBA2, mamba_d_ssm=128)
#: Zamba and Zamba2: Mamba layers, and a shared attention block run on the "hybrid" ones (head width
#: 2 x hidden / heads: the block reads the hidden state concatenated with the input embeddings).
_SHARED_BLOCK = dict(
    TINY_DECODER,
    num_hidden_layers=4,
    layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
    head_dim=32,
)
_ZAMBA = dict(_SHARED_BLOCK, n_mamba_heads=2, mamba_d_state=8, mamba_dt_rank=8, time_step_max=0.5)
#: Zamba2's Mamba2 layers: 8 heads x 16.
_ZAMBA2 = dict(_SHARED_BLOCK, n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=1, chunk_size=32)
#: Bamba: Mamba2 layers with attention at ``attn_layer_indices``.
_BAMBA = dict(TINY_DECODER, **_MAMBA2, num_hidden_layers=4, attn_layer_indices=[1, 3])


class HybridAdapter(StateAndAttentionLayers, LinearAttentionLayers, ModelAdapter):
    family = "hybrid"
    architectures = (
        "JambaForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "BambaForCausalLM",
        "FalconH1ForCausalLM",
        "ZambaForCausalLM",
        "Zamba2ForCausalLM",
    )
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
        "BambaForCausalLM": _BAMBA,
        "FalconH1ForCausalLM": _FALCON_H1,
        "ZambaForCausalLM": _ZAMBA,
        "Zamba2ForCausalLM": _ZAMBA2,
    }
    validation_variants = {
        # Attention first, MQA with 8 query heads, a wider Mamba state: the seeded scan on another shape.
        "JambaForCausalLM": [
            dict(
                _variant="attn-first-8q-kv1-state16",
                attn_layer_offset=0,
                num_attention_heads=8,
                num_key_value_heads=1,
                mamba_d_state=16,
            )
        ],
        "Lfm2ForCausalLM": [dict(_variant="8q-kv2-tied", num_attention_heads=8, head_dim=8, tie_word_embeddings=True)],
        "GraniteMoeHybridForCausalLM": [
            dict(_variant="mamba-mamba-attn", num_hidden_layers=3, layer_types=["mamba", "mamba", "attention"])
        ],
        "BambaForCausalLM": [
            dict(
                _variant="8q-kv1-hd8-groups2",
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=8,
                mamba_n_groups=2,
            ),
            dict(
                _variant="attn-first-4q-kv4-tied",
                attn_layer_indices=[0],
                num_key_value_heads=4,
                tie_word_embeddings=True,
            ),
        ],
        "FalconH1ForCausalLM": [
            # The gated RMS norm path, two B/C groups, MQA and real checkpoints' non-unit multipliers.
            dict(
                _variant="rmsnorm-groups2-8q-kv1",
                mamba_rms_norm=True,
                mamba_n_groups=2,
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=8,
                key_multiplier=0.5,
                attention_in_multiplier=0.8,
                ssm_in_multiplier=1.3,
                lm_head_multiplier=0.7,
                embedding_multiplier=1.5,
                mlp_multipliers=[0.9, 1.1],
                ssm_multipliers=[1.2, 0.8, 1.0, 1.1, 0.9],
            ),
            dict(_variant="3-layers-4q-kv4-hd32", num_hidden_layers=3, num_key_value_heads=4, head_dim=32),
        ],
        "ZambaForCausalLM": [
            dict(
                _variant="hybrid-first-8q-kv2-heads4",
                layers_block_type=["hybrid", "linear_attention", "hybrid"],
                num_hidden_layers=3,
                num_attention_heads=8,
                head_dim=16,
                n_mamba_heads=4,
            ),
        ],
        "Zamba2ForCausalLM": [
            # Two shared blocks with LoRA adapters (which need as many key/value heads as query
            # heads) and rotary positions in the shared attention.
            dict(
                _variant="2-blocks-adapters-rope-mha",
                num_mem_blocks=2,
                use_shared_attention_adapter=True,
                adapter_rank=8,
                use_mem_rope=True,
                num_key_value_heads=4,
                n_mamba_heads=4,
                mamba_ngroups=2,
            ),
            dict(_variant="8q-kv1-rope", num_attention_heads=8, num_key_value_heads=1, head_dim=16, use_mem_rope=True),
        ],
    }

    def forward(self, model: Any, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        return seeded.continue_forward(super().forward, model, input_ids, cache)

    def forward_kwargs(self, model: Any, input_ids: torch.Tensor, cache: Any) -> dict[str, Any]:
        return position_kwargs(input_ids, cache)


@hookimpl
def kvcdn_register_model_adapters() -> list[type[HybridAdapter]]:
    return [HybridAdapter]
