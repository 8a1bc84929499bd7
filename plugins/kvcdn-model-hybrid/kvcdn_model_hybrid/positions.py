"""Explicit position ids for every forward of a hybrid model, counted from the cached tokens.

transformers' ``generate()`` always passes ``position_ids``. A direct ``model(...)`` call leaves them
to the model, and Bamba's forward (transformers 5.24) then numbers the new tokens from 0 whatever the
cache holds: every decoded token is rotated as position 0 and each prefill chunk restarts at 0, so a
continuation diverges from a full prefill (token match 1/16 on a tiny Bamba) although the restored
Mamba2 states and keys/values are bitwise right. kvcdn numbers the positions itself, as
``generate()`` does, for every model of the family (the others compute the same numbers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def attention_length(cache: Any) -> int | None:
    """Tokens held by the cache's first attention layer; None when no layer has keys/values."""
    from transformers.cache_utils import CacheLayerMixin

    for layer in cache.layers:
        if isinstance(layer, CacheLayerMixin):
            return int(layer.get_seq_length())
    return None


def position_kwargs(input_ids: torch.Tensor, cache: Any) -> dict[str, torch.Tensor]:
    """``{"position_ids": [[past, ..., past + T - 1]]}`` for ``input_ids`` [1, T] on ``cache``.

    A cache without attention layers needs no positions (nothing is rotated): nothing is passed.
    """
    import torch

    past = attention_length(cache)
    if past is None:
        return {}
    steps = torch.arange(past, past + input_ids.shape[-1], device=input_ids.device)
    return {"position_ids": steps.unsqueeze(0).expand(input_ids.shape[0], -1)}
