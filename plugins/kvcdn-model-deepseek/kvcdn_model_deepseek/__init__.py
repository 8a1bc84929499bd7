"""kvcdn model family: DeepSeek-V2 and DeepSeek-V3, with their multi-head latent attention (MLA) cache.

MLA caches, per token and layer, a compressed latent and a rotary key shared by all heads, not
per-head keys and values. The export, import and checks live in core
(:class:`kvcdn_core.MLALatentLayers`, shared with Kimi Linear): the manifest says ``mla_latent`` with
the widths, the tensors are named ``latent`` and ``rotary_key``, a cache of any other shape or layer
type is refused, and a config whose ``num_key_value_heads`` differs from ``num_attention_heads``
(which crashes transformers 5.x's attention) is loaded with one key-value head per attention head.
"""

from __future__ import annotations

from kvcdn_core import LATENT_ROLE as LATENT
from kvcdn_core import ROTARY_KEY_ROLE as ROTARY_KEY
from kvcdn_core import TINY_DECODER, MLALatentLayers, ModelAdapter, hookimpl, mla_widths, ungroup_mla_heads

__version__ = "0.1.0"

__all__ = ["LATENT", "ROTARY_KEY", "DeepseekAdapter", "mla_widths", "ungroup_mla_heads"]

#: The tiny decoder with MLA's own head widths (its ``head_dim`` is the rotary key's, set by the config).
_MLA = dict(
    {k: v for k, v in TINY_DECODER.items() if k != "head_dim"},
    moe_intermediate_size=32,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


class DeepseekAdapter(MLALatentLayers, ModelAdapter):
    family = "deepseek"
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    validation_configs = {
        # DeepSeek-V2-Lite layout: no query compression, greedy expert routing, plain rotary.
        "DeepseekV2ForCausalLM": dict(_MLA, q_lora_rank=None, topk_method="greedy"),
        # DeepSeek-V3 layout: compressed queries, grouped routing, interleaved YaRN rotary.
        "DeepseekV3ForCausalLM": dict(
            _MLA,
            q_lora_rank=32,
            n_group=2,
            topk_group=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    }

    validation_variants = {
        "DeepseekV2ForCausalLM": [
            # A config whose num_key_value_heads differs (GQA defaults copied by converters), with
            # V2-Lite's YaRN rotary and a value head narrower than the key head.
            dict(
                _variant="kv2-yarn",
                num_key_value_heads=2,
                v_head_dim=8,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 0.707,
                    "mscale_all_dim": 0.707,
                },
            ),
            # More heads than key-value heads by 8, a wider rotary key, tied embeddings.
            dict(
                _variant="8q-kv1-tied",
                num_attention_heads=8,
                num_key_value_heads=1,
                qk_rope_head_dim=16,
                tie_word_embeddings=True,
            ),
        ],
        "DeepseekV3ForCausalLM": [
            dict(_variant="8q-kv2", num_attention_heads=8, num_key_value_heads=2, kv_lora_rank=16),
            # No query compression (V3-style routing), non-interleaved rotary.
            dict(_variant="no-q-lora", q_lora_rank=None, num_key_value_heads=1, rope_interleave=False),
        ],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [DeepseekAdapter]
