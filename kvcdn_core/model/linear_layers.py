"""Which cache layers are transformers' linear-attention layers, and the token count they carry.

Apart from :mod:`kvcdn_core.model.linear_attention` (the adapter mixin) because the base adapter
needs these too, and the mixin depends on the base adapter.
"""

from __future__ import annotations


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
