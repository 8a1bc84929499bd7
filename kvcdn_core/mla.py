"""Multi-head latent attention (MLA) cache layers: DeepSeek-V2/V3 and Kimi Linear's global layers.

MLA does not cache per-head keys and values. Each token leaves two small vectors per layer:

- the compressed latent, ``kv_a_layernorm(kv_a_proj_with_mqa(h)[:kv_lora_rank])``, from which every
  head's non-rotary key and its value are decompressed (``kv_b_proj``) at attention time;
- the rotary key, ``qk_rope_head_dim`` wide, shared by all heads.

transformers (5.x) caches exactly these two, in a ``DynamicLayer`` whose ``keys`` are the latent and
whose ``values`` are the rotary key, each viewed as one head. That layer type looks like full
attention to the base adapter, so :class:`MLALatentLayers` exports and imports it itself: the
manifest says ``mla_latent`` with the widths, and the tensors are named ``latent`` and
``rotary_key``. A cache whose shapes are not those of the latent (a transformers version that caches
decompressed heads, say) is refused rather than written under a wrong name.

``num_key_value_heads`` means nothing to MLA: every head decompresses its own key and value from the
shared latent, and no weight depends on it. transformers 5.x still divides the decompressed heads
into key-value groups by it, so a config whose ``num_key_value_heads`` differs from
``num_attention_heads`` (valid, and produced by converters that copy a GQA default) crashes in the
attention kernel. :meth:`MLALatentLayers.load` gives such a model one key-value head per attention
head, which is what the weights compute; the cache (the latent) is the same either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcdn_core import artifact as fmt
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.manifest import LayerEntry

#: Tensor roles of an ``mla_latent`` layer entry.
LATENT_ROLE = "latent"
ROTARY_KEY_ROLE = "rotary_key"


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


if TYPE_CHECKING:  # a mixin of ModelAdapter subclasses: type-check it as one
    from kvcdn_core.contracts.adapter import ModelAdapter as _MixinBase
else:
    _MixinBase = object


class MLALatentLayers(_MixinBase):
    """Adapter mixin: a model's plain ``DynamicLayer`` holds an MLA latent and rotary key.

    Any other attention layer type is refused (nothing written). Put it before ``ModelAdapter`` in the
    bases, after :class:`~kvcdn_core.linear_attention.LinearAttentionLayers` for hybrids whose other
    layers are linear attention (Kimi Linear).
    """

    def load(self, model_dir, device, dtype):
        model, tokenizer = super().load(model_dir, device, dtype)
        ungroup_mla_heads(model)
        return model, tokenizer

    def layer_kind(self, layer) -> str:
        from transformers.cache_utils import DynamicLayer

        if type(layer) is DynamicLayer:
            return fmt.MLA_LATENT
        raise KvcdnError(
            f"cache layer type {type(layer).__name__} is not an MLA latent layer the {self.family} adapter "
            "knows; no artifact was written"
        )

    def export_cache(self, model, cache):
        layers, tensors = super().export_cache(model, cache)
        rank, rope = mla_widths(model.config)
        typed = []
        for entry in layers:
            if entry.kind != fmt.MLA_LATENT:
                typed.append(entry)
                continue
            latent = tensors[entry.tensors[LATENT_ROLE]]
            rotary = tensors[entry.tensors[ROTARY_KEY_ROLE]]
            if latent.shape[1] != 1 or latent.shape[-1] != rank or rotary.shape[-1] != rope:
                raise KvcdnError(
                    f"layer {entry.index} caches tensors of shape {list(latent.shape)} and "
                    f"{list(rotary.shape)}, not the MLA latent ({rank}) and rotary key ({rope}) this "
                    "adapter stores; this transformers version caches MLA differently, no artifact was written"
                )
            typed.append(entry.with_fields(kv_lora_rank=rank, qk_rope_head_dim=rope))
        return typed, tensors

    def export_layer(self, index: int, layer) -> tuple[LayerEntry, dict[str, Any]]:
        entry = LayerEntry(index, self.layer_kind(layer))
        return entry, {LATENT_ROLE: layer.keys, ROTARY_KEY_ROLE: layer.values}

    def import_cache(self, model, layers, tensors, device):
        rank, rope = mla_widths(model.config)
        for entry in layers:
            if entry.kind != fmt.MLA_LATENT:
                continue
            stored = entry.family_fields.get("kv_lora_rank"), entry.family_fields.get("qk_rope_head_dim")
            if stored != (rank, rope):
                raise ArtifactError(
                    f"layer {entry.index} holds a latent of {stored[0]} and a rotary "
                    f"key of {stored[1]}, the model uses {rank} and {rope}"
                )
        return super().import_cache(model, layers, tensors, device)

    def import_layer(self, entry: LayerEntry, named: dict[str, Any], layer) -> None:
        kind = self.layer_kind(layer)
        if entry.kind != kind:
            raise ArtifactError(f"layer {entry.index} is '{entry.kind}' in the artifact, the model caches '{kind}'")
        latent, rotary = named[LATENT_ROLE], named[ROTARY_KEY_ROLE]
        layer.lazy_initialization(latent, rotary)
        layer.keys, layer.values = latent, rotary
