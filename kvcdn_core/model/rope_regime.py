"""RoPE scalings whose rotation depends on the sequence length, and how a cache stays exact with them.

Most RoPE variants (default, linear, llama3, yarn) rotate a position the same way whatever the
sequence length, so cached keys are exactly what a full prefill computes. Two do not:

- ``longrope`` (Phi-3 and others) uses its *short* factors while the sequence is at most
  ``original_max_position_embeddings`` tokens and its *long* factors for the whole sequence beyond.
  Keys cached while the sequence was short were rotated with the short factors; a full prefill of
  the longer sequence rotates them with the long ones. When a forward pass crosses the threshold,
  :func:`guarded_forward` recomputes the prefix with the long factors (the ids are kept on the cache
  while it is short), so a chunked prefill equals a full one. A cache restored from an artifact
  carries no ids: crossing from it is refused with a clear error.
- ``dynamic`` (NTK) rescales every frequency from the current length once it passes
  ``max_position_embeddings``, so no cache continues exactly past that length: refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcdn_core.errors import KvcdnError

_IDS_ATTR = "_kvcdn_short_regime_ids"


def length_dependent_rope(config) -> tuple[str, int] | None:
    """``(rope type, threshold in tokens)`` when the model's RoPE depends on sequence length."""
    cfg = config.get_text_config(decoder=True)
    params = getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(params, dict):
        return None
    # Per-layer-type models (Gemma 3) keep one parameter dict per layer type.
    candidates = [params] if "rope_type" in params else [p for p in params.values() if isinstance(p, dict)]
    for p in candidates:
        kind = p.get("rope_type")
        if kind == "longrope":
            limit = (
                p.get("original_max_position_embeddings")
                or getattr(cfg, "original_max_position_embeddings", None)
                or cfg.max_position_embeddings
            )
            return kind, int(limit)
        if kind == "dynamic":
            return kind, int(cfg.max_position_embeddings)
    return None


def guarded_forward(
    adapter: Any, model: Any, input_ids: Any, cache: Any, run: Callable[[Any, Any, Any], tuple[Any, Any]]
) -> tuple[Any, Any]:
    """``run(model, input_ids, cache)`` made exact (or refused) for length-dependent RoPE."""
    regime = length_dependent_rope(model.config)
    if regime is None:
        return run(model, input_ids, cache)
    kind, limit = regime
    cached = int(cache.get_seq_length())
    new = int(input_ids.shape[-1])
    total = cached + new
    if kind == "dynamic":
        if cached and total > limit:
            raise KvcdnError(
                f"dynamic (NTK) RoPE scaling re-rotates every position once a sequence passes {limit} "
                f"tokens, so a cache of {cached} tokens cannot be continued to {total} tokens exactly; "
                f"keep context and continuation within {limit} tokens"
            )
        return run(model, input_ids, cache)
    seen = getattr(cache, _IDS_ATTR, None)
    if cached and cached <= limit < total:
        if seen is None or int(seen.shape[-1]) != cached:
            raise KvcdnError(
                f"LongRoPE switches every position from its short to its long factors once a sequence "
                f"passes {limit} tokens; this cache of {cached} tokens was computed with the short "
                f"factors, so it cannot be continued to {total} tokens exactly; keep context and "
                f"continuation within {limit} tokens, or generate the artifact from more than {limit} tokens"
            )
        import torch

        everything = torch.cat([seen.to(input_ids.device), input_ids], dim=-1)
        logits, fresh = run(model, everything, adapter.new_cache(model))
        return logits[:, -new:], fresh
    logits, out = run(model, input_ids, cache)
    if total <= limit:
        import torch

        ids = input_ids.detach().cpu()
        if cached == 0:
            setattr(out, _IDS_ATTR, ids)
        elif seen is not None:
            setattr(out, _IDS_ATTR, torch.cat([seen, ids], dim=-1))
    return logits, out
