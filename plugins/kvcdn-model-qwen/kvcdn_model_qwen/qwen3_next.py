"""Qwen3-Next: a hybrid of gated-DeltaNet linear-attention layers and full-attention layers.

A linear-attention layer caches a causal-convolution state and a recurrent state instead of per-token
keys and values. That state summarises the whole prefix, so the layer is recorded as
``linear_attention`` and the artifact is reusable only as a whole prefix (``reuse: whole_prefix``);
cropping it is refused. transformers' gated-delta-rule kernels take the saved state as their initial
state on multi-token input, so chunked prefill and multi-token continuation need no special path.
"""

from __future__ import annotations

from kvcdn_core import artifact as fmt
from kvcdn_core import ArtifactError

QWEN3_NEXT_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
    # Three linear-attention layers then one full-attention layer, the real model's pattern.
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, decoder_sparse_step=1,
)


def is_linear_attention(layer) -> bool:
    """A pure linear-attention cache layer (not a hybrid layer that also holds keys and values)."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)


class LinearAttentionLayers:
    """Adapter mixin: export and import linear-attention layers; other layers go to the base adapter.

    A cache without linear-attention layers (Qwen2, Qwen3, Qwen3-MoE) never reaches this code.
    """

    def layer_kind(self, layer) -> str:
        if is_linear_attention(layer):
            return fmt.LINEAR_ATTENTION
        return super().layer_kind(layer)

    def export_layer(self, index: int, layer):
        if not is_linear_attention(layer):
            return super().export_layer(index, layer)
        entry = {"kind": fmt.LINEAR_ATTENTION, "conv_kernel": int(layer.conv_kernel_size[0] or 0)}
        return entry, self.export_linear_state(layer)

    def import_layer(self, entry: dict, named: dict, layer) -> None:
        if not is_linear_attention(layer):
            return super().import_layer(entry, named, layer)
        if entry["kind"] != fmt.LINEAR_ATTENTION:
            raise ArtifactError(
                f"layer {entry['index']} is '{entry['kind']}' in the artifact but "
                f"'{fmt.LINEAR_ATTENTION}' in the model"
            )
        self.import_linear_state(entry, named, layer)
