"""Linear-attention and recurrent cache layers inside hybrid models (gated DeltaNet, Mamba, short conv).

A linear-attention layer caches a causal-convolution state and a recurrent state instead of per-token
keys and values. That state summarises the whole prefix, so the layer is recorded as
``linear_attention`` and the artifact is reusable only as a whole prefix (``reuse: whole_prefix``);
cropping it is refused. Families whose caches mix such layers with attention layers (Qwen3-Next,
Qwen3.5, Jamba, Granite 4 hybrid, LFM2) put :class:`LinearAttentionLayers` before
:class:`~kvcdn_core.contracts.adapter.ModelAdapter` in their bases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import LayerEntry
from kvcdn_core.errors import ArtifactError
from kvcdn_core.model.linear_layers import is_linear_attention

if TYPE_CHECKING:  # a mixin of ModelAdapter subclasses: type-check it as one
    from kvcdn_core.contracts.adapter import ModelAdapter as _MixinBase
else:
    _MixinBase = object


class LinearAttentionLayers(_MixinBase):
    """Adapter mixin: export and import linear-attention layers; other layers go to the base adapter.

    A cache without linear-attention layers never reaches this code.
    """

    def layer_kind(self, layer) -> str:
        if is_linear_attention(layer):
            return artifact.LINEAR_ATTENTION
        return super().layer_kind(layer)

    def export_layer(self, index: int, layer):
        if not is_linear_attention(layer):
            return super().export_layer(index, layer)
        entry = LayerEntry(
            index, artifact.LINEAR_ATTENTION, family_fields={"conv_kernel": int(layer.conv_kernel_size[0] or 0)}
        )
        return entry, self.export_linear_state(layer)

    def import_layer(self, entry: LayerEntry, named: dict, layer) -> None:
        if not is_linear_attention(layer):
            return super().import_layer(entry, named, layer)
        if entry.kind != artifact.LINEAR_ATTENTION:
            raise ArtifactError(
                f"layer {entry.index} is '{entry.kind}' in the artifact but '{artifact.LINEAR_ATTENTION}' in the model"
            )
        self.import_linear_state(entry, named, layer)
