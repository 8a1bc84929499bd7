"""Multi-head latent attention (MLA) cache layers, with or without DeepSeek sparse attention (DSA).

Shared by every family whose attention is DeepSeek's MLA (DeepSeek-V2/V3/V3.2, GLM-MoE-DSA, Kimi Linear's global layers), so it
lives next to the format's ``mla_latent`` and ``mla_indexed`` kinds rather than in one family plugin
that the others would have to import.

MLA does not cache per-head keys and values. Each token leaves two small vectors per layer, and
transformers (5.x) caches exactly these in a ``DynamicLayer``, each viewed as one head:

- ``keys``: the compressed latent, ``kv_a_layernorm(kv_a_proj_with_mqa(h)[:kv_lora_rank])``, from which
  every head's non-rotary key and its value are decompressed (``kv_b_proj``) at attention time;
- ``values``: the rotary key, ``qk_rope_head_dim`` wide, rotated at the token's position.

DeepSeek sparse attention adds a lightning indexer: a one-head key per token (``index_head_dim`` wide)
that later queries score to pick the ``index_topk`` keys they attend to. transformers keeps it in the
same layer (``DynamicIndexedLayer.indexer_keys``, ``[batch, tokens, index_head_dim]``). Without it a
restored cache would select other keys, so it is stored too: kind ``mla_indexed``, a third tensor.
A DSA layer that reuses an earlier layer's selection (GLM-MoE-DSA's ``"shared"`` indexer layers) has
no indexer keys and is stored as plain ``mla_latent``.

``num_key_value_heads`` means nothing to MLA (every head decompresses its own key and value from the
shared latent; no weight depends on it), but transformers 5.x still divides the decompressed heads
into key-value groups by it, so a config where the two counts differ crashes in the attention kernel.
:func:`ungroup_mla_heads` sets one key-value head per attention head, which is what the weights
compute; the cache is the same either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import LayerEntry
from kvcdn_core.errors import ArtifactError, KvcdnError

LATENT, ROTARY_KEY, INDEXER_KEY = artifact.MLA_ROLES
MLA_KINDS = (artifact.MLA_LATENT, artifact.MLA_INDEXED)


def mla_widths(config) -> tuple[int, int]:
    """``(kv_lora_rank, qk_rope_head_dim)``: the widths of the latent and of the rotary key."""
    return int(config.kv_lora_rank), int(config.qk_rope_head_dim)


def has_indexer(config, index: int) -> bool:
    """Whether layer ``index`` runs its own DSA indexer (and so caches indexer keys).

    Every ``indexed_attention`` layer does, except GLM-MoE-DSA's ``"shared"`` ones, which reuse the
    previous indexer layer's selection.
    """
    layer_types = getattr(config, "layer_types", None) or ()
    if index >= len(layer_types) or layer_types[index] != "indexed_attention":
        return False
    indexer_types = getattr(config, "indexer_types", None)
    return indexer_types is None or indexer_types[index] != "shared"


def ungroup_mla_heads(model) -> None:
    """One key-value head per attention head: MLA decompresses a key and value for every head.

    Without this, attention repeats the already per-head keys ``heads / num_key_value_heads`` times
    and the shapes no longer match (see the module docstring).
    """
    for module in model.modules():
        if hasattr(module, "kv_lora_rank") and hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = 1


def _is_indexed(layer) -> bool:
    from transformers.cache_utils import DynamicIndexedLayer

    return type(layer) is DynamicIndexedLayer


if TYPE_CHECKING:  # a mixin of ModelAdapter subclasses: type-check it as one
    from kvcdn_core.contracts.adapter import ModelAdapter as _MixinBase
else:
    _MixinBase = object


class MlaLayers(_MixinBase):
    """Adapter mixin for MLA models: MLA latent layers, DSA layers with their indexer keys.

    Put it before :class:`~kvcdn_core.contracts.adapter.ModelAdapter` in the bases, after
    :class:`~kvcdn_core.model.linear_attention.LinearAttentionLayers` for hybrids whose other layers are
    linear attention (Kimi Linear). A layer of any other type, or tensors that are not one head of
    the model's widths (a transformers version that caches decompressed heads, say), are refused
    rather than written under a wrong name.
    """

    def load(self, model_dir, device, dtype):
        model, tokenizer = super().load(model_dir, device, dtype)
        ungroup_mla_heads(model)
        return model, tokenizer

    def layer_kind(self, layer) -> str:
        from transformers.cache_utils import DynamicLayer

        if _is_indexed(layer):
            return artifact.MLA_INDEXED if layer.is_indexer_initialized else artifact.MLA_LATENT
        if type(layer) is DynamicLayer:
            return artifact.MLA_LATENT
        raise KvcdnError(
            f"cache layer type {type(layer).__name__} is not an MLA latent layer the {self.family} adapter "
            "knows; no artifact was written"
        )

    def export_layer(self, index: int, layer) -> tuple[LayerEntry, dict[str, Any]]:
        kind = self.layer_kind(layer)
        named = {LATENT: layer.keys, ROTARY_KEY: layer.values}
        if kind == artifact.MLA_INDEXED:
            if layer.indexer_position_ids is not None:
                raise KvcdnError(
                    f"layer {index} caches indexer positions, which the {self.family} adapter does not "
                    "store; no artifact was written"
                )
            named[INDEXER_KEY] = layer.indexer_keys
        return LayerEntry(index, kind), named

    def export_cache(self, model, cache):
        layers, tensors = super().export_cache(model, cache)
        rank, rope = mla_widths(model.config)
        typed = []
        for entry in layers:
            if entry.kind not in MLA_KINDS:
                typed.append(entry)
                continue
            index = entry.index
            latent = tensors[entry.tensors[LATENT]]
            rotary = tensors[entry.tensors[ROTARY_KEY]]
            if latent.shape[1] != 1 or latent.shape[-1] != rank or rotary.shape[-1] != rope:
                raise KvcdnError(
                    f"layer {index} caches tensors of shape {list(latent.shape)} and "
                    f"{list(rotary.shape)}, not the MLA latent ({rank}) and rotary key ({rope}) this "
                    "adapter stores; this transformers version caches MLA differently, no "
                    "artifact was written"
                )
            entry = entry.with_fields(kv_lora_rank=rank, qk_rope_head_dim=rope)
            if (entry.kind == artifact.MLA_INDEXED) != has_indexer(model.config, index):
                raise KvcdnError(
                    f"layer {index} {'holds' if entry.kind == artifact.MLA_INDEXED else 'lacks'} DSA indexer "
                    "keys where the model's config says otherwise; no artifact was written"
                )
            if entry.kind == artifact.MLA_INDEXED:
                indexer = tensors[entry.tensors[INDEXER_KEY]]
                width = int(model.config.index_head_dim)
                if indexer.dim() != 3 or indexer.shape[1] != latent.shape[-2] or indexer.shape[-1] != width:
                    raise KvcdnError(
                        f"layer {index} caches indexer keys of shape {list(indexer.shape)}, not one "
                        f"{width}-wide key per token; no artifact was written"
                    )
                entry = entry.with_fields(index_head_dim=width)
            typed.append(entry)
        return typed, tensors

    def import_cache(self, model, layers, tensors, device):
        rank, rope = mla_widths(model.config)
        for entry in layers:
            if entry.kind not in MLA_KINDS:
                continue
            index = entry.index
            expected = artifact.MLA_INDEXED if has_indexer(model.config, index) else artifact.MLA_LATENT
            if entry.kind != expected:
                raise ArtifactError(f"layer {index} is '{entry.kind}' in the artifact, the model caches '{expected}'")
            stored = entry.family_fields.get("kv_lora_rank"), entry.family_fields.get("qk_rope_head_dim")
            if stored != (rank, rope):
                raise ArtifactError(
                    f"layer {index} holds a latent of {stored[0]} and a rotary "
                    f"key of {stored[1]}, the model uses {rank} and {rope}"
                )
            width = entry.family_fields.get("index_head_dim")
            if expected == artifact.MLA_INDEXED and width != int(model.config.index_head_dim):
                raise ArtifactError(
                    f"layer {index} holds indexer keys of width {width}, the model uses {model.config.index_head_dim}"
                )
        return super().import_cache(model, layers, tensors, device)

    def import_layer(self, entry: LayerEntry, named: dict[str, Any], layer) -> None:
        kind = self.layer_kind(layer)  # refuses a layer type this mixin does not know
        if entry.kind not in MLA_KINDS:
            raise ArtifactError(f"layer {entry.index} is '{entry.kind}' in the artifact, the model caches '{kind}'")
        latent, rotary = named[LATENT], named[ROTARY_KEY]
        layer.lazy_initialization(latent, rotary)
        layer.keys, layer.values = latent, rotary
        if entry.kind == artifact.MLA_INDEXED:
            if not _is_indexed(layer):
                raise ArtifactError(f"layer {entry.index} holds DSA indexer keys, the model's cache has none")
            layer.lazy_initialization_indexer(named[INDEXER_KEY])
            layer.indexer_keys = named[INDEXER_KEY]

    def crop_layer(self, entry: LayerEntry, layer, n_tokens: int) -> None:
        super().crop_layer(entry, layer, n_tokens)
        if entry.kind == artifact.MLA_INDEXED:  # one indexer key per token: [batch, tokens, width]
            layer.indexer_keys = layer.indexer_keys[:, :n_tokens, :]
