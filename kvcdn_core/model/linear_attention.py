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


def is_linear_attention(layer) -> bool:
    """A pure linear-attention cache layer (not a hybrid layer that also holds keys and values)."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)


def set_linear_token_count(layer, tokens: int) -> None:
    """Tell a linear-attention layer how many tokens its state holds, where transformers counts them.

    From transformers 5.25 such a layer keeps its own count (``cumulative_length_linear``), and a cache
    whose first layer is linear answers ``get_seq_length()`` from it: the next forward's positions and
    causal mask start there. A state put in from outside (a restored artifact, a family that keeps the
    state itself) must set it, or the continuation restarts at position 0. Earlier releases ask the
    first attention layer instead and keep no count: nothing to do there.
    """
    count = getattr(layer, "cumulative_length_linear", None)
    if count is not None:
        count.fill_(int(tokens))


def count_restored_states(layers) -> None:
    """Give each linear-attention layer of a restored cache the token count of the first attention
    layer beside it (see :func:`set_linear_token_count`); a cache without both kinds is left as is."""
    linear = [layer for layer in layers if is_linear_attention(layer)]
    attention = next((layer for layer in layers if not is_linear_attention(layer)), None)
    if linear and attention is not None:
        tokens = int(attention.get_seq_length())
        for layer in linear:
            set_linear_token_count(layer, tokens)


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
