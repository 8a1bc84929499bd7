"""kvcdn model family: DeepSeek-V2, V3 and V3.2, with their multi-head latent attention (MLA) cache.

MLA does not cache per-head keys and values. Each token leaves two small vectors per layer:

- the compressed latent, ``kv_a_layernorm(kv_a_proj_with_mqa(h)[:kv_lora_rank])``, from which every
  head's non-rotary key and its value are decompressed (``kv_b_proj``) at attention time;
- the rotary key, ``qk_rope_head_dim`` wide, rotated at the token's position and shared by all heads.

DeepSeek-V3.2 adds DeepSeek sparse attention (DSA): a lightning indexer caches one more small key per
token and layer, and each query attends only to the ``index_topk`` keys it scores highest. The export
and import of all three (and the refusals) live in core (:class:`kvcdn_core.MlaLayers`), shared with
GLM-MoE-DSA; this plugin names the architectures and their tiny validation shapes. The manifest says
``mla_latent`` (V2, V3) or ``mla_indexed`` (V3.2), with the widths; tensors are ``latent``,
``rotary_key`` and ``indexer_key``.

``num_key_value_heads`` means nothing to MLA, but transformers 5.x still groups the decompressed heads
by it and crashes when it differs from ``num_attention_heads``; the adapter loads such a model with
one key-value head per attention head (:func:`kvcdn_core.ungroup_mla_heads`), which is what the
weights compute.
"""

from __future__ import annotations

from kvcdn_core import (
    TINY_DEEPSEEK_MOE,
    TINY_MLA,
    MlaLayers,
    ModelAdapter,
    artifact,
    hookimpl,
    mla_widths,
    ungroup_mla_heads,
)

__version__ = "0.1.0"

LATENT, ROTARY_KEY, INDEXER_KEY = artifact.MLA_ROLES
__all__ = ["INDEXER_KEY", "LATENT", "ROTARY_KEY", "DeepseekAdapter", "mla_widths", "ungroup_mla_heads"]

_MLA = dict(TINY_MLA, **TINY_DEEPSEEK_MOE)

#: A YaRN rotary (4x) for the variants that stretch a 64-token original window.
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

#: DeepSeek sparse attention, scaled down: each query attends to its 16 best-scored keys, far fewer
#: than the validation context (96+ tokens), so the selection decides what the model sees. At least
#: 16 indexer heads (V3.2 has 64): with 4, about 5% of the scores are exactly 0 (every head's ReLU
#: is 0), top-k then picks among exact ties, and torch breaks ties differently for different key
#: counts, so transformers' own chunked prefill stops matching its one-pass prefill (3/16 tokens).
_DSA = dict(_MLA, q_lora_rank=32, index_topk=16, index_head_dim=16, index_n_heads=16)


class DeepseekAdapter(MlaLayers, ModelAdapter):
    family = "deepseek"
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
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
        # DeepSeek-V3.2: V3's layout plus the DSA indexer on every layer.
        "DeepseekV32ForCausalLM": dict(_DSA, n_group=2, topk_group=1),
    }

    validation_variants = {
        "DeepseekV2ForCausalLM": [
            # A config whose num_key_value_heads differs (GQA defaults copied by converters), with
            # V2-Lite's YaRN rotary and a value head narrower than the key head.
            dict(
                _variant="kv2-yarn",
                num_key_value_heads=2,
                v_head_dim=8,
                rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707),
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
        "DeepseekV32ForCausalLM": [
            # Grouped heads (8:2), a wider indexer with fewer heads selecting 24 keys, YaRN rotary.
            dict(
                _variant="8q-kv2-yarn",
                num_attention_heads=8,
                num_key_value_heads=2,
                qk_rope_head_dim=16,
                index_topk=24,
                index_head_dim=32,
                index_n_heads=32,
                rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0),
            ),
            # Three layers selecting only 8 keys each, a narrower latent, tied embeddings.
            dict(_variant="3l-top8-tied", num_hidden_layers=3, index_topk=8, kv_lora_rank=16, tie_word_embeddings=True),
        ],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[DeepseekAdapter]]:
    return [DeepseekAdapter]
