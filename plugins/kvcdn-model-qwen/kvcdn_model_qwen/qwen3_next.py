"""Qwen3-Next: a hybrid of gated-DeltaNet linear-attention layers and full-attention layers.

A linear-attention layer caches a causal-convolution state and a recurrent state instead of per-token
keys and values. That state summarises the whole prefix, so the layer is recorded as
``linear_attention`` and the artifact is reusable only as a whole prefix (``reuse: whole_prefix``);
cropping it is refused. transformers' gated-delta-rule kernels take the saved state as their initial
state on multi-token input, so chunked prefill and multi-token continuation need no special path.
"""

from __future__ import annotations

from kvcdn_core import TINY_DECODER

#: Qwen3.5 text model: three linear-attention layers then one full-attention layer, the real model's
#: pattern (its MoE variant adds the experts).
QWEN3_5_CONFIG = dict(
    TINY_DECODER,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)

#: Qwen3-Next: the same layers, with experts on every layer.
QWEN3_NEXT_CONFIG = dict(
    QWEN3_5_CONFIG,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    decoder_sparse_step=1,
)
