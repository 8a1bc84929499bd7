"""Composing several cached documents into one prompt, in any order (issue #28, after CacheBlend).

A RAG prompt is documents in an order that changes per query, then a question. Prefix reuse serves
only the first document; this module reuses every document's artifact:

1. **Position correction.** Every artifact was computed from position 0. Document ``i`` now starts
   at offset ``o_i``; its keys were rotated by ``R(p)`` and must be ``R(p + o_i)``. Rotary
   rotations compose (``R(p + o) = R(o) R(p)``, the same 2-D rotation per frequency pair in every
   layout), so the cached keys are rotated once more by ``o_i`` with the model's own rotary module
   and its own ``apply_rotary_pos_emb`` (interleaved or half-split layouts, partial rotary). The
   module's cos/sin carry an attention scaling (YaRN's mscale) that was applied once already: it
   is divided out. Values carry no position and are kept.
2. **Selective recomputation.** Cross-document attention is missing from the moved caches. A share
   ``R`` of the non-first tokens is recomputed: the chosen tokens run through the model in one pass
   at their true positions (explicit ``position_ids``) on the composed cache, under a mask that lets
   a token see every earlier position once: the cached entry of a token that is not recomputed, the
   fresh one of a token that is. Their fresh keys and values then replace the cached ones in every
   layer. (CacheBlend narrows the set layer by layer on GPU kernels; a fixed set chosen up front is
   the same computation for that set.)
3. **R = 1** is the full prefill itself: the first artifact (the prompt's true prefix, exact as in
   prefix reuse) is kept and every later token is prefilled on it, token-exact with a full prefill.

Token selection rules (:data:`RULES`): ``deviation`` (CacheBlend's: the tokens whose values at an
early layer differ most between the moved cache and a fresh computation of that layer) and
``doc-start`` (each later document's first tokens, which the moved cache lets attend to nothing of
the documents before them; attention sinks sit there).

Multimodal rotary sections (mrope: Qwen3.5's text models, the Qwen2-VL, 2.5-VL and 3-VL text
stacks) give each frequency the temporal, height or width position; a text token has the three
equal, so its rotation is the plain one at its position and a shift by ``o`` moves every section by
``o``. The model's own rotary module, given one position, expands it to equal sections and
recomposes them, so keys move as above. kvcdn's artifacts are always text positions: it prefills
token ids at ``0..T-1`` and has no vision-language adapter, so no artifact holds image positions. A
rotary module that returns its angles per section (not recomposed) is refused.

Multi-head latent attention (DeepSeek V2/V3/V3.2, GLM-MoE-DSA) caches a latent, which carries no
position and is kept, and a rotary key stored apart, which is moved (:func:`move_mla_keys`); so is
the rotary part of a DSA indexer key.

Sliding-window layers keep their last ``window - 1`` tokens. A composition that fits in them is
exact as above (every token is in reach of every later one, as in a full prefill); a longer one is
refused (each document's cache would lack what the full prefill's window holds).

Refused with one line: artifacts of different models; recurrent and linear-attention layers (their
state summarises the prefix); a composition longer than a sliding window; models with no rotary
embedding (absolute positions, ALiBi) or whose attention rotates one tensor at a time (Gemma 3n);
length-dependent RoPE (dynamic NTK, LongRoPE) past the length where its rotation changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from typing import Any

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import manifest_of
from kvcdn_core.errors import KvcdnError
from kvcdn_core.model.defaults import COMPOSE_RULES as RULES
from kvcdn_core.model.defaults import DEFAULT_COMPOSE_RULE as DEFAULT_RULE
from kvcdn_core.model.files import fingerprint_differences

#: The layer whose value deviation ranks tokens under ``deviation``: layer 0's values depend on the
#: token alone (identical in both caches), layer 1's already on the attention over the prompt.
DEVIATION_LAYER = 1


@dataclasses.dataclass
class Composition:
    """A composed cache and how it was made."""

    cache: Any
    ids: list[int]
    offsets: list[int]
    recomputed: list[int]
    rule: str
    recompute: float

    @property
    def prefix_tokens(self) -> int:
        """Tokens of the first artifact: reused exactly, never recomputed."""
        return self.offsets[1] if len(self.offsets) > 1 else len(self.ids)

    def summary(self) -> str:
        return (
            f"composed {len(self.offsets)} artifacts: {len(self.ids)} context tokens, "
            f"{len(self.recomputed)} recomputed ({self.rule}, --recompute {self.recompute:g})"
        )

    def as_dict(self) -> dict:
        return {
            "context_tokens": len(self.ids),
            "documents": len(self.offsets),
            "offsets": self.offsets,
            "recompute": self.recompute,
            "rule": self.rule,
            "recomputed_tokens": len(self.recomputed),
        }


def model_differences(first, other) -> list[str]:
    """What differs between two manifests' models and compute dtypes (empty: composable)."""
    differs = fingerprint_differences(dataclasses.asdict(first.model), dataclasses.asdict(other.model))
    if other.compute_dtype != first.compute_dtype:
        differs.append("compute dtype")
    return differs


def check_same_model(headers: list[artifact.Header]) -> None:
    """All artifacts must share one model fingerprint and compute dtype: refuse otherwise."""
    first = manifest_of(headers[0])
    for header in headers[1:]:
        differs = model_differences(first, manifest_of(header))
        if differs:
            raise KvcdnError(
                f"cannot compose {headers[0].path} and {header.path}: made with different models "
                f"({', '.join(differs)} differ)"
            )


#: Layer kinds whose caches can be moved to a new offset (sliding windows: within the window).
MOVABLE = (artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW, artifact.MLA_LATENT, artifact.MLA_INDEXED)


def composable(session, layers) -> None:
    """Refuse, with the reason in one line, a model whose caches cannot be moved to a new offset."""
    for entry in layers:
        if entry.kind not in MOVABLE:
            why = "a recurrent or linear-attention state summarises the whole prefix"
            raise KvcdnError(f"cannot compose: layer {entry.index} is '{entry.kind}': {why}")
    if is_mla(session.model):
        _mla_turn(session.model, 1, session.device)
    else:
        _rotary(session.model)


def is_mla(model) -> bool:
    """Whether the model's attention is multi-head latent attention (a latent and a rotary key cached)."""
    return getattr(model.config, "kv_lora_rank", None) is not None


def _rotary(model):
    """``(rotary module, apply_rotary_pos_emb of the model's attention)``, or a one-line refusal."""
    inner = getattr(model, "base_model", model)
    rotary = getattr(inner, "rotary_emb", None)
    layers = getattr(inner, "layers", None)
    attention = _attention(layers[0]) if layers is not None and len(layers) else None
    apply = getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None) if attention else None
    name = type(model).__name__
    if rotary is None or apply is None:
        raise KvcdnError(
            f"cannot compose with {name}: it has no rotary position embedding kvcdn can move (absolute "
            "positions, ALiBi, or rotary kept inside the attention), so cached keys cannot change offset"
        )
    return rotary, apply


#: Model types whose attention's code, not an attribute, decides which layers rotate their keys:
#: Cohere 2 only its sliding layers, EXAONE 4 only its sliding ones once it has a window (its global
#: layers then have no positions).
_ROTATES = {
    "cohere2": lambda attention: attention.sliding_window is not None,
    "exaone4": lambda attention: attention.sliding_window is None or attention.is_sliding,
}


def rotated_layers(model) -> list[bool]:
    """Per decoder layer, whether its keys carry rotary positions (SmolLM3 and Llama 4 leave some
    layers without, Cohere 2 and EXAONE 4 their global ones: their keys need no move)."""
    inner = getattr(model, "base_model", model)
    rotates = _ROTATES.get(str(getattr(model.config, "model_type", "")), lambda attention: True)
    attentions = [_attention(layer) for layer in inner.layers]
    return [bool(getattr(attention, "use_rope", True)) and rotates(attention) for attention in attentions]


def _attention(layer):
    return getattr(layer, "self_attn", None) or getattr(layer, "attention", None)


def move_keys(model, keys, offset: int, layer: int = 0):
    """Keys of decoder layer ``layer`` computed at positions ``0..T-1`` re-rotated to
    ``offset..offset+T-1`` (``[B, H, T, D]``).

    A rotary module whose frequencies differ per layer type (Gemma 3 and OLMo 3: local and global
    layers) is asked for the layer's own type. Rotated in float32 and cast back, so a bfloat16 cache
    loses nothing more than its own rounding.
    """
    import torch

    if offset == 0:
        return keys
    rotary, apply = _rotary(model)
    probe = torch.zeros(1, dtype=torch.float32, device=keys.device)
    position = torch.tensor([[offset]], dtype=torch.long, device=keys.device)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        layer_type = model.config.layer_types[layer]
        cos, sin = rotary(probe, position, layer_type)
        scale = float(getattr(rotary, f"{layer_type}_attention_scaling", 1.0) or 1.0)
    else:
        cos, sin = rotary(probe, position)
        scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    if cos.shape[:-1] != (1, 1):
        raise KvcdnError(
            f"cannot compose with {type(model).__name__}: its rotary module returns angles per position "
            f"section ({list(cos.shape)}), which kvcdn cannot move"
        )
    cos, sin = cos.float() / scale, sin.float() / scale
    k = keys.float()
    try:  # the model's apply takes the whole head (half-width cos of chunked layouts, its own partial split)
        _, moved = apply(k, k, cos, sin)
    except RuntimeError:  # partial rotary split by the attention: the rotary part leads the head
        width = cos.shape[-1]
        _, moved = apply(k[..., :width], k[..., :width], cos, sin)
        moved = torch.cat([moved, k[..., width:]], dim=-1)
    except TypeError:  # Gemma 3n rotates one tensor at a time, and shares caches between layers
        raise KvcdnError(
            f"cannot compose with {type(model).__name__}: its attention applies rotary positions in a form "
            "kvcdn does not move"
        ) from None
    return moved.to(keys.dtype)


def _mla_turn(model, offset: int, device):
    """``(turn, interleaved)``: the rotation by ``offset``, one complex number per frequency pair
    (``[1, 1, pairs]``), from the MLA model's own rotary module with its attention scaling (YaRN's
    mscale) divided out; and whether the cached rotary key keeps its pairs interleaved.

    DeepSeek-V2's module returns complex numbers and its attention multiplies interleaved pairs by
    them, keeping them interleaved. V3, V3.2 (``rope_interleave`` or not) and GLM-MoE-DSA return
    ``cat(freqs, freqs)`` cos and sin, and their attention writes the rotated key half-split.
    """
    import torch

    inner = getattr(model, "base_model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        raise KvcdnError(
            f"cannot compose with {type(model).__name__}: its latent attention has no rotary module kvcdn can use"
        )
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    angles = rotary(probe, torch.tensor([[offset]], dtype=torch.long, device=device))
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    if isinstance(angles, torch.Tensor) and torch.is_complex(angles):
        return angles / scale, True
    cos, sin = angles  # the first half holds one angle per pair
    half = cos.shape[-1] // 2
    return torch.complex(cos[..., :half].float(), sin[..., :half].float()) / scale, False


def _rotate_pairs(x, turn, interleaved: bool):
    """``x`` (float32) with each frequency pair rotated by ``turn``: pairs ``(x0, x1), (x2, x3)...``
    when interleaved, ``(x_i, x_{i + D/2})`` otherwise; the layout is kept."""
    import torch

    if interleaved:
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * turn).flatten(-2)
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half], x[..., half:]) * turn
    return torch.cat([pairs.real, pairs.imag], dim=-1)


def move_mla_keys(model, rotary_keys, offset: int, indexer: bool = False):
    """MLA's cached rotary keys (``[B, 1, T, rope]``), or with ``indexer`` DSA indexer keys
    (``[B, T, D]``, whose first ``rope`` channels are rotary and always half-split), computed at
    ``0..T-1``, re-rotated to ``offset..offset+T-1``. Rotated in float32, cast back.
    """
    import torch

    if offset == 0:
        return rotary_keys
    turn, interleaved = _mla_turn(model, offset, rotary_keys.device)
    x = rotary_keys.float()
    width = turn.shape[-1] * 2
    if indexer:
        moved = torch.cat([_rotate_pairs(x[..., :width], turn, False), x[..., width:]], dim=-1)
    else:
        moved = _rotate_pairs(x, turn, interleaved)
    return moved.to(rotary_keys.dtype)


def _check_length(session, total: int) -> None:
    from kvcdn_core.model.rope_regime import length_dependent_rope

    regime = length_dependent_rope(session.model.config)
    if regime is not None and total > regime[1]:
        raise KvcdnError(
            f"cannot compose {total} tokens: {regime[0]} RoPE rotates positions differently past "
            f"{regime[1]} tokens, so moved keys would not match; keep the prompt within {regime[1]} tokens"
        )


def _check_window(session, cache, total: int) -> None:
    """Sliding-window layers keep their last ``window - 1`` tokens: a composition that fits in them
    is what a full prefill leaves there (every token in reach of every later one); a longer one is
    refused, since each document's cache would lack what a full prefill's window holds."""
    for i, layer in enumerate(session.adapter.cache_layers(cache)):
        if getattr(layer, "is_sliding", False) and total > layer.sliding_window - 1:
            raise KvcdnError(
                f"cannot compose {total} tokens: layer {i} has a sliding window that keeps only the last "
                f"{layer.sliding_window - 1}; keep the documents within {layer.sliding_window - 1} tokens"
            )


def load_parts(session, headers: list[artifact.Header], force: bool = False):
    """Each artifact's ``(cache, token ids)``, after the checks that refuse a composition."""
    from kvcdn_core import runtime

    check_same_model(headers)
    composable(session, manifest_of(headers[0]).layers)
    return [runtime.load_cache(session, header, force=force) for header in headers]


def compose(
    session,
    headers: list[artifact.Header],
    recompute: float = 0.0,
    rule: str = DEFAULT_RULE,
    force: bool = False,
    parts=None,
) -> Composition:
    """One cache for the artifacts' documents in the order given, ``recompute`` of the later tokens redone.

    ``parts`` (from :func:`load_parts`) skips the load, for callers that compose one set several ways.
    """
    if not 0.0 <= recompute <= 1.0:
        raise KvcdnError(f"--recompute must be between 0 and 1, not {recompute}")
    if rule not in RULES:
        raise KvcdnError(f"unknown selection rule {rule!r}; one of: {', '.join(RULES)}")
    parts = parts if parts is not None else load_parts(session, headers, force)
    ids: list[int] = []
    offsets: list[int] = []
    for _, part_ids in parts:
        offsets.append(len(ids))
        ids += part_ids
    _check_length(session, len(ids))
    _check_window(session, parts[0][0], len(ids))
    first_cache, first_ids = parts[0]
    later = len(ids) - len(first_ids)
    count = round(recompute * later)
    if later and count == later:  # the full prefill: the true prefix kept, the rest prefilled on it
        cache = session.adapter.fork_cache(first_cache)
        cache, _ = _prefill(session, ids[len(first_ids) :], cache)
        return Composition(cache, ids, offsets, list(range(len(first_ids), len(ids))), rule, recompute)
    cache = _concatenate(session, parts, offsets)
    selected: list[int] = []
    if count:
        if rule == "deviation":
            selected = _by_deviation(session, first_cache, ids, len(first_ids), cache, count)
        else:
            selected = _by_doc_start(offsets, len(ids), recompute)
        recompute_tokens(session, cache, ids, selected)
    return Composition(cache, ids, offsets, selected, rule, recompute)


def _prefill(session, ids: list[int], cache):
    from kvcdn_core import runtime

    return runtime.prefill(session, ids, cache=cache, progress=False)


def _concatenate(session, parts, offsets: list[int]):
    """A cache holding every part's keys (moved to its offset) and values, in order.

    MLA layers hold the latent in ``keys`` (no position: kept) and the rotary key in ``values``
    (moved), and DSA layers their indexer keys (moved) besides.
    """
    import torch

    model = session.model
    cache = session.adapter.new_cache(model)
    targets = session.adapter.cache_layers(cache)
    sources = [session.adapter.cache_layers(part_cache) for part_cache, _ in parts]
    mla = is_mla(model)
    rotated = rotated_layers(model)
    for i, target in enumerate(targets):
        layers = [(s[i], o) for s, o in zip(sources, offsets)]
        if mla:
            keys = torch.cat([layer.keys for layer, _ in layers], dim=-2)
            values = torch.cat([move_mla_keys(model, layer.values, o) for layer, o in layers], dim=-2)
        else:
            keys = torch.cat(
                [move_keys(model, layer.keys, o, i) if rotated[i] else layer.keys for layer, o in layers], dim=-2
            )
            values = torch.cat([layer.values for layer, _ in layers], dim=-2)
        target.lazy_initialization(keys, values)
        target.keys, target.values = keys, values
        if getattr(target, "is_sliding", False):  # every token is within the window (checked)
            target.cumulative_length = keys.shape[-2]
        if getattr(layers[0][0], "is_indexer_initialized", False):
            indexer = torch.cat(
                [move_mla_keys(model, layer.indexer_keys, o, indexer=True) for layer, o in layers], dim=1
            )
            target.lazy_initialization_indexer(indexer)
            target.indexer_keys = indexer
    return cache


def _by_doc_start(offsets: list[int], total: int, share: float) -> list[int]:
    """Each later document's first ``round(share * its length)`` tokens."""
    ends = offsets[1:] + [total]
    chosen: list[int] = []
    for start, end in zip(offsets[1:], ends[1:]):
        chosen += range(start, start + round(share * (end - start)))
    return chosen


def model_turn(session):
    """A context around a forward pass made here, outside the adapter: a server's adapter (with a
    ``turn`` method) waits in it for its turn on the model and stops a cancelled request; local
    runs get nothing."""
    turn = getattr(session.adapter, "turn", None)
    return turn() if turn is not None else contextlib.nullcontext()


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the layer it watches has run."""


def _by_deviation(session, first_cache, ids: list[int], prefix: int, cache, count: int) -> list[int]:
    """CacheBlend's rule: the ``count`` later tokens whose values at :data:`DEVIATION_LAYER` differ
    most (L2 over heads) between the composed cache and a fresh pass of the first layers.

    The fresh pass runs only the later tokens, on the first artifact's (exact) cache, and stops
    after the watched layer: its cost is that share of the model's layers.
    """
    import torch

    from kvcdn_core.contracts.adapter import cache_keyword

    model = session.model
    layers = getattr(model, "base_model", model).layers
    watched = min(DEVIATION_LAYER, len(layers) - 1)

    def stop(*_):
        raise _Stop

    probe = session.adapter.fork_cache(first_cache)
    hook = layers[watched].register_forward_hook(stop)
    try:
        with model_turn(session), torch.inference_mode():
            model(
                input_ids=torch.tensor([ids[prefix:]], device=session.device),
                use_cache=True,
                logits_to_keep=1,
                **{cache_keyword(model): probe},
            )
    except _Stop:
        pass
    finally:
        hook.remove()
    slot = "keys" if is_mla(model) else "values"  # MLA: the latent, from which values are decompressed
    fresh = getattr(session.adapter.cache_layers(probe)[watched], slot)[..., prefix:, :]
    moved = getattr(session.adapter.cache_layers(cache)[watched], slot)[..., prefix:, :]
    deviation = (fresh.float() - moved.float()).pow(2).sum(dim=(0, 1, 3))
    top = torch.topk(deviation, count).indices + prefix
    return sorted(int(i) for i in top)


def recompute_tokens(session, cache, ids: list[int], selected: list[int]) -> None:
    """Recompute ``selected`` positions' keys and values on ``cache`` (all of ``ids``), in place.

    One forward of the selected tokens at their true positions. Each attends to every earlier
    position once: the cached entry of a position not selected, the fresh entry of one selected
    (and itself). Their fresh entries then replace the cached ones in every layer.
    """
    import torch

    from kvcdn_core.contracts.adapter import cache_keyword

    if not selected:
        return
    model, device = session.model, session.device
    total = len(ids)
    chosen = torch.tensor(selected, dtype=torch.long, device=device)
    positions = torch.arange(total, device=device)
    sees_cached = positions[None, :] < chosen[:, None]
    sees_cached[:, chosen] = False
    sees_fresh = chosen[None, :] <= chosen[:, None]
    allowed = torch.cat([sees_cached, sees_fresh], dim=-1)
    dtype = getattr(torch, session.dtype)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    sliding = [layer for layer in session.adapter.cache_layers(cache) if getattr(layer, "is_sliding", False)]
    for layer in sliding:  # keep the stale entries past the window until they are replaced below
        layer.record_past = True
    with model_turn(session), torch.inference_mode():
        model(
            input_ids=torch.tensor([[ids[i] for i in selected]], device=device),
            position_ids=chosen[None, :],
            attention_mask=mask[None, None],
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword(model): cache},
        )
        for layer in session.adapter.cache_layers(cache):
            keys, values = layer.keys[..., :total, :].clone(), layer.values[..., :total, :].clone()
            keys[..., chosen, :] = layer.keys[..., total:, :]
            values[..., chosen, :] = layer.values[..., total:, :]
            layer.keys, layer.values = keys, values
            if getattr(layer, "is_indexer_initialized", False):  # DSA: [batch, tokens, width]
                indexer = layer.indexer_keys[:, :total, :].clone()
                indexer[:, chosen, :] = layer.indexer_keys[:, total:, :]
                layer.indexer_keys = indexer
    for layer in sliding:
        layer.record_past, layer.cumulative_length = False, total
