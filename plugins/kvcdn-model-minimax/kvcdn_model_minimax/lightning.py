"""MiniMax-Text-01 (``MiniMaxForCausalLM``): lightning attention layers alternating with softmax ones.

A lightning-attention layer is linear attention with a fixed per-head decay: what it carries from one
token to the next is one ``head_dim x head_dim`` matrix per head, the decayed sum of ``kᵀv`` over
every token read so far. That matrix is the layer's whole cache. The softmax layers keep keys and
values as usual.

transformers 5.24 keeps the matrices in ``MiniMaxCache.linear_cache``, a list beside the cache's
layers, and fills the lightning layers' slots of ``layers`` with empty ``DynamicLayer`` objects. Those
look like attention layers holding no token, so on a model whose first layer is a lightning one
(MiniMax-Text-01: seven lightning layers, then a softmax one) the cache reports a length of 0 after a
prefill, and the next forward restarts positions and the causal mask at 0.

:func:`lightning_cache` lays the cache out per layer instead, as transformers does for its other
hybrids: a ``LinearAttentionLayer`` holding the matrix (as its recurrent state) for a lightning
layer, a ``DynamicLayer`` for a softmax one. It is still a ``MiniMaxCache`` (the model accepts no
other), so the length comes from the first softmax layer, and core's
:class:`~kvcdn_core.LinearAttentionLayers` exports the matrices as ``linear_attention`` layers (one
``recurrent_state`` tensor, ``[1, heads, head_dim, head_dim]``, no convolution). The state summarises
the whole prefix: artifacts are reusable only as that prefix.

Continuing from a state, transformers feeds a multi-token input through the token-by-token recurrence
(a fresh prefill uses 256-token blocks); both compute the same sums, in a different order, so chunked
prefill and a restored cache agree with one full prefill up to float32 rounding (checked token-exact
by ``kvcdn validate --family minimax``).
"""

from __future__ import annotations

import functools
from typing import Any

from kvcdn_core import LinearAttentionLayers, TinyDecoderFamily, is_linear_attention

#: TINY_DECODER plus MiniMax's own fields. Lightning blocks of 16 tokens so that a 64-token prefill
#: chunk crosses block boundaries (the real model uses 256).
_LIGHTNING = dict(
    num_hidden_layers=4,
    block_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    # MiniMax-Text-01 starts with lightning layers; alternating keeps a tiny random model's output
    # dependent on the context (the variant below has the real 3:1 ratio, first layer lightning).
    layer_types=["linear_attention", "full_attention"] * 2,
)


class LightningAdapter(LinearAttentionLayers, TinyDecoderFamily):
    family = "minimax"
    tiny_changes = {"MiniMaxForCausalLM": _LIGHTNING}
    validation_variants = {
        "MiniMaxForCausalLM": [
            dict(
                _variant="3lightning-1softmax-8q-kv1",
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=8,
                block_size=32,
            ),
        ],
    }

    def new_cache(self, model: Any) -> Any:
        return lightning_cache(model.config)


def lightning_cache(config: Any) -> Any:
    """An empty ``MiniMaxCache`` laid out per layer (see the module docstring)."""
    return _lightning_cache_class()(config)


@functools.cache
def _lightning_cache_class() -> type:
    """The cache class, built on first use: transformers is imported only when a model runs."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class LightningCache(MiniMaxCache):  # type: ignore[misc]  # transformers is typed as Any here
        """``MiniMaxCache`` whose lightning states live in per-layer ``LinearAttentionLayer`` objects."""

        def __init__(self, config: Any) -> None:
            # DynamicCache's layout from config.layer_types; MiniMaxCache's own side list is not used.
            DynamicCache.__init__(self, config=config)

        def get_linear_cache(self, layer_idx: int) -> Any:
            layer = self.layers[layer_idx]
            return layer.recurrent_states[0] if layer.has_previous_state[0] else None

        def set_linear_cache(self, layer_idx: int, linear_cache: Any) -> None:
            layer = self.layers[layer_idx]
            layer.update_recurrent_state(linear_cache)
            layer.has_previous_state[0] = True

        def __len__(self) -> int:
            return len(self.layers)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            # A lightning layer keeps no token count (the model sets its state through
            # set_linear_cache), so a length asked of one comes from the first softmax layer:
            # transformers 5.24 did that for every cache, 5.25 asks the layer itself.
            if layer_idx >= len(self.layers):
                return 0
            candidates = (self.layers[layer_idx], *self.layers)
            softmax = next((layer for layer in candidates if not is_linear_attention(layer)), None)
            return int(softmax.get_seq_length()) if softmax is not None else 0

    return LightningCache
