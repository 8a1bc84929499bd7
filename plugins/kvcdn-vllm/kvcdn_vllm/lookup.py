"""Per-request prefix lookup in a chunk store, and the chunk plan a worker loads from.

The scheduler asks a :class:`PrefixLookup` for the stored artifact that shares the longest token
prefix with a prompt. The one here, :class:`StoreLookup`, asks the store's own prefix index
(:func:`kvcdn_core.store.index.lookup`: a trie over chain keys, read incrementally, never the
store's listing or its chunks) and then reads the hit's record (one small object). Another
implementation (the hosted service's lookup route, taking chain keys) only has to return the same
:class:`Match`. Workers fetch chunks by digest through a :class:`ChunkSource`. No torch here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvcdn_core import KvcdnError, artifact
from kvcdn_core.store import index, keys
from kvcdn_core.store.chunkstore import ChunkStore, chunk_key
from kvcdn_core.store.record import ArtifactRecord

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Match:
    """The stored artifact sharing the longest prefix with a prompt: ``prefix_tokens`` exact."""

    name: str
    prefix_tokens: int
    record: ArtifactRecord


class PrefixLookup(Protocol):
    """What the scheduler calls once per request: the best stored match of ``prompt_ids``, or None
    (nothing shared, or the store unreachable: that is a miss, never an error)."""

    def lookup(self, prompt_ids: list[int]) -> Match | None: ...


class ChunkSource(Protocol):
    """What a worker's tier fetches a missing chunk from: its bytes, or None when it is not there."""

    def fetch(self, digest: str) -> bytes | None: ...


def engine_root(fingerprint: dict, compute_dtype: str) -> str:
    """The chain root of an engine's caches: its model fingerprint, unquantized, in its compute dtype."""
    return keys.root_key(fingerprint, keys.representation(compute_dtype, None))


def open_store(uri: str) -> ChunkStore:
    """The chunk store at ``uri`` (a directory, ``file://``, ``s3://``, any backend that stores bytes)."""
    from kvcdn_core import open_storage

    return ChunkStore(open_storage(uri))


class StoreLookup:
    """:class:`PrefixLookup` and :class:`ChunkSource` on a chunk store's own index and chunks."""

    def __init__(self, store: ChunkStore, root: str, warn: Callable[[str], None]):
        self.store = store
        self.root = root
        self._warn = warn
        self._warned: set[str] = set()

    def lookup(self, prompt_ids: list[int]) -> Match | None:
        try:
            hits = index.lookup(self.store.backend, self.root, prompt_ids, limit=1)
            if not hits or hits[0].prefix_tokens == 0:
                return None
            return Match(hits[0].name, hits[0].prefix_tokens, self.store.record(hits[0].name))
        except Exception as exc:  # an unreachable or damaged store is a miss, never a failed request
            detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
            self._warn_once(f"prefix lookup in the store failed: {detail}")
            return None

    def fetch(self, digest: str) -> bytes | None:
        return self.store.backend.read_bytes(chunk_key(digest))

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)


@dataclasses.dataclass(frozen=True)
class Part:
    """One stored object of a load plan: tokens ``[start, start + tokens)`` of every chunked tensor."""

    digest: str
    start: int
    tokens: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """A chunked tensor as it sits in each part: ``outer`` runs of ``tokens`` rows of ``last`` items."""

    name: str
    outer: int
    last: int
    dtype: str  # torch's name: float32, bfloat16, ...


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """What a worker needs to copy tokens ``[start, end)`` of a stored artifact: the parts covering
    them and the layout of their bytes. Small, so it travels in the connector's metadata."""

    name: str
    tensors: tuple[TensorSlot, ...]
    parts: tuple[Part, ...]


def plan(record: ArtifactRecord, start: int, end: int) -> ChunkPlan:
    """The parts of ``record`` that hold tokens ``[start, end)``, and how their bytes are laid out."""
    header = record.parsed_header()
    tensors = []
    for name in record.chunked:
        entry = header.entries[name]
        shape = entry["shape"]
        tensors.append(
            TensorSlot(name, math.prod(shape[:-2]), int(shape[-1]), artifact.tensor_io.DTYPES[entry["dtype"]][1])
        )
    parts, t0 = [], 0
    for chunk in record.chunks:
        for piece in chunk.parts:
            if t0 < end and t0 + piece.tokens > start:
                parts.append(Part(piece.digest, t0, piece.tokens, piece.bytes))
            t0 += piece.tokens
    if t0 < end:
        raise KvcdnError(f"artifact '{record.name}' holds {t0} tokens, not {end}")
    return ChunkPlan(record.name, tuple(tensors), tuple(parts))


def slices(plan: ChunkPlan, got: Sequence[tuple[Part, bytes]], start: int, end: int) -> dict[str, torch.Tensor]:
    """Each chunked tensor's tokens ``[start, end)`` as ``[outer, end - start, last]``, read from the
    bytes of ``plan``'s parts (``got``: each part with its bytes, in token order)."""
    import warnings

    import torch

    pieces: dict[str, list[torch.Tensor]] = {t.name: [] for t in plan.tensors}
    with warnings.catch_warnings():  # read-only bytes: the views are only read (sliced, then copied)
        warnings.simplefilter("ignore", UserWarning)
        for part, data in got:
            offset = 0
            for t in plan.tensors:
                dtype = getattr(torch, t.dtype)
                count = t.outer * part.tokens * t.last
                view = torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
                pieces[t.name].append(view.view(t.outer, part.tokens, t.last))
                offset += count * view.element_size()
    base = got[0][0].start if got else start
    return {name: torch.cat(parts, dim=1)[:, start - base : end - base] for name, parts in pieces.items()}
