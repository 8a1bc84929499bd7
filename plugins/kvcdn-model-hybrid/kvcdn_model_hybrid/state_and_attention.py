"""Cache layers holding a Mamba state and attention keys/values at once (Falcon-H1, Zamba, Zamba2).

In these models one decoder layer runs a Mamba mixer and an attention block on the same cache
index, so transformers 5.24 gives that layer one ``LinearAttentionAndFullAttentionLayer``: the
convolution and SSM states of the mixer, and the keys and values of the attention. kvcdn records it
as one ``linear_and_full_attention`` layer entry with the roles of both (``key``, ``value``,
``conv_state``, ``recurrent_state``) and ``conv_kernel``. The state summarises the whole prefix, so
the artifact is reusable only as the whole prefix, like a ``linear_attention`` layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcdn_core import LINEAR_AND_FULL_ATTENTION, ArtifactError, KvcdnError, LayerEntry

#: The roles of the attention part; every other role of the layer is a state.
ATTENTION_ROLES = ("key", "value")


def is_linear_and_full_attention(layer: Any) -> bool:
    """A transformers cache layer holding a linear-attention state and full-attention keys/values."""
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

    return type(layer) is LinearAttentionAndFullAttentionLayer


if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

if TYPE_CHECKING:  # a mixin of ModelAdapter subclasses: type-check it as one
    from kvcdn_core import ModelAdapter as _MixinBase
else:
    _MixinBase = object


class StateAndAttentionLayers(_MixinBase):
    """Adapter mixin: export and import ``LinearAttentionAndFullAttentionLayer`` cache layers whole;
    other layers go to the next base."""

    def layer_kind(self, layer: Any) -> str:
        if is_linear_and_full_attention(layer):
            return LINEAR_AND_FULL_ATTENTION
        return super().layer_kind(layer)

    def export_layer(self, index: int, layer: Any) -> tuple[LayerEntry, dict[str, torch.Tensor]]:
        if not is_linear_and_full_attention(layer):
            return super().export_layer(index, layer)
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            raise KvcdnError(f"cache layer {index} holds a state but no keys yet; prefill some tokens first")
        entry = LayerEntry(
            index, LINEAR_AND_FULL_ATTENTION, family_fields={"conv_kernel": int(layer.conv_kernel_size[0] or 0)}
        )
        return entry, {"key": layer.keys, "value": layer.values, **self.export_linear_state(layer)}

    def import_layer(self, entry: LayerEntry, named: dict[str, torch.Tensor], layer: Any) -> None:
        if not is_linear_and_full_attention(layer):
            return super().import_layer(entry, named, layer)
        if entry.kind != LINEAR_AND_FULL_ATTENTION:
            raise ArtifactError(
                f"layer {entry.index} is '{entry.kind}' in the artifact but '{LINEAR_AND_FULL_ATTENTION}' in the model"
            )
        keys, values = named["key"], named["value"]
        # Two positional tensors reach the attention part's initialisation (the layer dispatches on
        # its arguments); the states go through the linear-attention import below.
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        states = {role: t for role, t in named.items() if role not in ATTENTION_ROLES}
        self.import_linear_state(entry, states, layer)
