"""kvcdn model family: DeepSeek-V2 and DeepSeek-V3, with their multi-head latent attention (MLA) cache.

MLA does not cache per-head keys and values. Each token leaves two small vectors per layer:

- the compressed latent, ``kv_a_layernorm(kv_a_proj_with_mqa(h)[:kv_lora_rank])``, from which every
  head's non-rotary key and its value are decompressed (``kv_b_proj``) at attention time;
- the rotary key, ``qk_rope_head_dim`` wide, rotated at the token's position and shared by all heads.

transformers (5.x) caches exactly these two, in a ``DynamicLayer`` whose ``keys`` are the latent and
whose ``values`` are the rotary key, each viewed as one head. That layer type looks like full
attention to the base adapter, so this plugin exports and imports it itself: the manifest says
``mla_latent`` with the widths, and the tensors are named ``latent`` and ``rotary_key``. A cache whose
shapes are not those of the latent (a transformers version that caches decompressed heads, say) is
refused rather than written under a wrong name.

``num_key_value_heads`` means nothing to MLA: every head decompresses its own key and value from the
shared latent, and no weight depends on it. transformers 5.x still divides the decompressed heads
into key-value groups by it, so a config whose ``num_key_value_heads`` differs from
``num_attention_heads`` (valid, and produced by converters that copy a GQA default) crashes in the
attention kernel. The adapter loads such a model with one key-value head per attention head, which
is what the weights compute; the cache (the latent) is the same either way.
"""

from __future__ import annotations

from typing import Any

from kvcdn_core import TINY_DECODER, ArtifactError, KvcdnError, LayerEntry, ModelAdapter, hookimpl
from kvcdn_core import artifact as fmt

__version__ = "0.1.0"

LATENT = "latent"
ROTARY_KEY = "rotary_key"

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


def mla_widths(config) -> tuple[int, int]:
    """``(kv_lora_rank, qk_rope_head_dim)``: the widths of the latent and of the rotary key."""
    return int(config.kv_lora_rank), int(config.qk_rope_head_dim)


def ungroup_mla_heads(model) -> None:
    """One key-value head per attention head: MLA decompresses a key and value for every head.

    Without this, attention repeats the already per-head keys ``heads / num_key_value_heads`` times
    and the shapes no longer match (see the module docstring).
    """
    for module in model.modules():
        if hasattr(module, "kv_lora_rank") and hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = 1


class DeepseekAdapter(ModelAdapter):
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

    def load(self, model_dir, device, dtype):
        model, tokenizer = super().load(model_dir, device, dtype)
        ungroup_mla_heads(model)
        return model, tokenizer

    def layer_kind(self, layer) -> str:
        from transformers.cache_utils import DynamicLayer

        if type(layer) is DynamicLayer:
            return fmt.MLA_LATENT
        raise KvcdnError(
            f"cache layer type {type(layer).__name__} is not an MLA latent layer the deepseek adapter "
            "knows; no artifact was written"
        )

    def export_cache(self, model, cache):
        layers, tensors = super().export_cache(model, cache)
        rank, rope = mla_widths(model.config)
        for entry in layers:
            latent = tensors[entry.tensors[LATENT]]
            rotary = tensors[entry.tensors[ROTARY_KEY]]
            if latent.shape[1] != 1 or latent.shape[-1] != rank or rotary.shape[-1] != rope:
                raise KvcdnError(
                    f"layer {entry.index} caches tensors of shape {list(latent.shape)} and "
                    f"{list(rotary.shape)}, not the MLA latent ({rank}) and rotary key ({rope}) this "
                    "adapter stores; this transformers version caches DeepSeek differently, no "
                    "artifact was written"
                )
        return [entry.with_fields(kv_lora_rank=rank, qk_rope_head_dim=rope) for entry in layers], tensors

    def export_layer(self, index: int, layer) -> tuple[LayerEntry, dict[str, Any]]:
        return LayerEntry(index, self.layer_kind(layer)), {LATENT: layer.keys, ROTARY_KEY: layer.values}

    def import_cache(self, model, layers, tensors, device):
        rank, rope = mla_widths(model.config)
        for entry in layers:
            if entry.kind != fmt.MLA_LATENT:
                raise ArtifactError(
                    f"layer {entry.index} is '{entry.kind}' in the artifact, the model caches '{fmt.MLA_LATENT}'"
                )
            stored = entry.family_fields.get("kv_lora_rank"), entry.family_fields.get("qk_rope_head_dim")
            if stored != (rank, rope):
                raise ArtifactError(
                    f"layer {entry.index} holds a latent of {stored[0]} and a rotary "
                    f"key of {stored[1]}, the model uses {rank} and {rope}"
                )
        return super().import_cache(model, layers, tensors, device)

    def import_layer(self, entry: LayerEntry, named: dict[str, Any], layer) -> None:
        self.layer_kind(layer)
        latent, rotary = named[LATENT], named[ROTARY_KEY]
        layer.lazy_initialization(latent, rotary)
        layer.keys, layer.values = latent, rotary


@hookimpl
def kvcdn_register_model_adapters():
    return [DeepseekAdapter]
