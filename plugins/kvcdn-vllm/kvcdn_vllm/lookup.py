"""Per-request prefix lookup in a chunk store, and the chunk plan a worker loads from.

The scheduler asks a :class:`PrefixLookup` for the stored artifact that shares the longest token
prefix with a prompt. The one here, :class:`StoreLookup`, asks the store's own prefix index
(:func:`kvcdn_core.store.index.lookup`: a trie over chain keys, read incrementally, never the
store's listing or its chunks) and then reads the hit's record (one small object). A backend
that declares the ``prefix_lookup`` capability (the hosted service) answers lookups itself:
:class:`IndexLookup` sends it the prompt's chain keys in one request whose answer carries the
hit's chunk grant (record and signed URLs), and its workers fetch each missing chunk through those
URLs (they travel in the load plan). :func:`open_lookup` picks one by the declaration. Workers fetch
chunks by digest through a :class:`ChunkSource`. No torch here.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcdn_core import KvcdnError, ObjectNotFound, StorageBackend, artifact
from kvcdn_core.store import index, keys, pack
from kvcdn_core.store.chunkstore import ChunkStore, chunk_key
from kvcdn_core.store.record import ArtifactRecord

if TYPE_CHECKING:
    import torch

    from kvcdn_vllm.tier import ChunkBytes


@dataclasses.dataclass(frozen=True)
class Match:
    """The stored artifact sharing the longest prefix with a prompt: ``prefix_tokens`` exact."""

    name: str
    prefix_tokens: int
    record: ArtifactRecord
    #: per object digest, where the source reads it (the hosted service's signed URLs); empty for
    #: a chunk store, whose chunks are read by key
    locations: Mapping[str, str] = dataclasses.field(default_factory=dict)


class PrefixLookup(Protocol):
    """What the scheduler calls once per request: the best stored match of ``prompt_ids``, or None
    (nothing shared, or the store unreachable: that is a miss, never an error)."""

    def lookup(self, prompt_ids: list[int]) -> Match | None: ...


class ChunkSource(Protocol):
    """What a worker's tier fetches a missing chunk from: its bytes, read into ``into`` (memory the
    tier chose, the size the plan says) where the source can, ``landed(n)`` told as the first ``n``
    are in place (:func:`kvcdn_core.store.pack.read_into`), or None when it is not there.
    ``locate`` is told a plan's locations before its chunks are fetched."""

    def fetch(
        self, digest: str, into: memoryview, landed: Callable[[int], None] | None = None
    ) -> ChunkBytes | None: ...

    def locate(self, plan: ChunkPlan) -> None: ...


def engine_root(fingerprint: dict, compute_dtype: str) -> str:
    """The chain root of an engine's caches: its model fingerprint, unquantized, in its compute dtype."""
    return keys.root_key(fingerprint, keys.representation(compute_dtype, None))


class StoreLookup:
    """:class:`PrefixLookup` and :class:`ChunkSource` on a chunk store's own index and chunks."""

    def __init__(self, store: ChunkStore, root: str, warn: Callable[[str], None]):
        self.store = store
        self.root = root
        self._warn = warn
        self._warned: set[str] = set()

    def warm(self) -> None:
        """Read the store's index now (the scheduler does, on a thread of its own, at engine start),
        so that the first request's lookup reads only the index objects written since, not all of
        them. A lookup meanwhile reads the index itself, as without this. A store that fails here is
        left to that lookup to report, in its one line."""
        try:
            index.load(self.store.backend)
        except Exception:
            pass

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

    def fetch(self, digest: str, into: memoryview, landed: Callable[[int], None] | None = None) -> ChunkBytes | None:
        try:
            with self.store.backend.open_read(chunk_key(digest)) as stream:
                return pack.read_into(stream, into, landed)
        except ObjectNotFound:
            return None

    def locate(self, plan: ChunkPlan) -> None:
        """A chunk's key is its digest: nothing to learn."""

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)


#: signed URLs a hosted worker remembers at most (the latest plans' chunks)
MAX_LOCATIONS = 65_536
#: chunk grants (record and URLs) a hosted scheduler keeps, and how long before their URLs expire
#: it stops using one (a worker fetches within a step or two of the lookup)
MAX_GRANTS = 1024
#: after a lookup that timed out, the scheduler asks the store again only after a pause, doubled at
#: each timeout in a row up to the last figure (seconds): a service that drops packets must not
#: hold every new request's scheduling step for a timeout
QUIET_FIRST_S = 1.0
QUIET_MAX_S = 30.0
GRANT_MARGIN_S = 60.0
#: kept grants a lookup names as held, so the answer need not carry them again
MAX_HELD = 4


class IndexLookup:
    """:class:`PrefixLookup` and :class:`ChunkSource` on a backend that answers prefix lookups itself
    (it declares ``prefix_lookup``: the hosted service). Per request, one request: the prompt's
    chain keys (never token ids or a listing), asking for the best match's chunk grant (its record
    and a URL per object) in the answer. A grant is kept per artifact id until shortly before its
    URLs expire (an artifact id's record never changes), and a lookup names the kept grants it
    likely ends on (``held``), so the answer need not carry them again. Only when the server granted
    another artifact than the refinement picks, and none is kept for it, the hit's chunks route is
    asked (a second request). An artifact stored whole (uploaded without ``--chunked``) is skipped
    with one line per artifact: a whole-file download per request is what this path exists to
    avoid."""

    def __init__(
        self,
        backend: StorageBackend,
        root: str,
        warn: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ):
        self.backend: Any = backend  # a hosted backend: prefix_lookup_grant too
        self.root = root
        self._warn = warn
        self._clock = clock
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._locations: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._grants: collections.OrderedDict[str, tuple[ArtifactRecord | None, dict[str, str], float]] = (
            collections.OrderedDict()
        )
        #: a query's chain key -> the artifact a lookup through it found (whose grant may be kept)
        self._found: collections.OrderedDict[str, str] = collections.OrderedDict()
        #: whether the backend's read_chunk takes ``landed`` (a plugin written before it was added may not)
        self._reports_landing = _takes(getattr(backend, "read_chunk", None), "landed")
        self._quiet_until = 0.0  # no lookup before this time (the service timed out)
        self._quiet_s = 0.0
        try:  # the HTTP client (TLS context, credentials: 0.1 s here) at engine start, not in a first load
            getattr(backend, "client", None)
        except Exception:
            pass  # the first lookup or fetch reports it, in one line

    def lookup(self, prompt_ids: list[int]) -> Match | None:
        """The prompt's match, or None. It runs on the scheduler's step, so it waits little: one
        attempt, a short timeout, and after a timeout no lookup for a pause (a miss only costs
        recompute; a refused connection fails at once and pauses nothing)."""
        if self._clock() < self._quiet_until:
            return None
        try:
            query_keys: list[str] = []
            ask = getattr(self.backend, "prefix_lookup_grant", None)  # a backend without it: two requests
            if ask is not None:
                hits, granted = ask(self.root, prompt_ids, 1, lambda full: self._held(full, query_keys), impatient=True)
            else:
                hits, granted = self.backend.prefix_lookup(self.root, prompt_ids, 0, 1), None
            self._quiet_s = 0.0
            if not hits or hits[0].prefix_tokens < keys.BLOCK_TOKENS:
                return None  # under one block: vLLM (16 or more tokens a block) would load nothing
            hit = hits[0]
            if granted is not None and granted[0] == hit.ref and granted[1] is not None:
                self._keep(hit.ref, granted[1])
            grant = self._grant(hit)
            record, locations, _ = grant if grant is not None else (None, {}, 0.0)
            if record is None:
                self._warn_once(f"skipping stored artifact '{hit.name}': it is stored whole, not by chunks")
                return None
            depth = min(hit.prefix_tokens // keys.CHUNK_TOKENS, len(query_keys))
            if depth:
                self._found[query_keys[depth - 1]] = hit.ref
                self._found.move_to_end(query_keys[depth - 1])
                while len(self._found) > MAX_GRANTS:
                    self._found.popitem(last=False)
            return Match(hit.name, hit.prefix_tokens, record, locations)
        except Exception as exc:  # an unreachable or refusing service is a miss, never a failed request
            detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
            if isinstance(exc, TimeoutError):
                self._quiet_s = min(max(2 * self._quiet_s, QUIET_FIRST_S), QUIET_MAX_S)
                self._quiet_until = self._clock() + self._quiet_s
                detail += f"; lookups pause after each timeout, {QUIET_FIRST_S:g} s doubling up to {QUIET_MAX_S:g} s"
            self._warn_once(f"prefix lookup in the store failed: {detail}")
            return None

    def _held(self, full: list[str], query_keys: list[str]) -> list[str]:
        """The kept grants the lookup of a query with full-chunk keys ``full`` likely ends on: the
        artifacts earlier lookups found through its deepest keys (their grants still valid)."""
        query_keys[:] = full
        now, held = self._clock(), []
        for key in reversed(full):
            ref = self._found.get(key)
            kept = self._grants.get(ref) if ref else None
            if ref and ref not in held and kept is not None and kept[2] - GRANT_MARGIN_S > now:
                held.append(ref)
                if len(held) == MAX_HELD:
                    break
        return held

    def _grant(self, hit: Any) -> tuple[ArtifactRecord | None, dict[str, str], float] | None:
        """The hit's record and URLs: kept ones while they hold, else asked for (and kept). A
        record of None: the artifact is stored whole."""
        now = self._clock()
        kept = self._grants.get(hit.ref)
        if kept is not None and kept[2] - GRANT_MARGIN_S > now:
            self._grants.move_to_end(hit.ref)
            return kept
        grant = self.backend.hit_chunks(hit)
        if grant is not None:
            self._keep(hit.ref, grant)
        return grant

    def _keep(self, ref: str, grant: tuple[ArtifactRecord | None, dict[str, str], float]) -> None:
        self._grants[ref] = grant
        self._grants.move_to_end(ref)
        while len(self._grants) > MAX_GRANTS:
            self._grants.popitem(last=False)

    def locate(self, plan: ChunkPlan) -> None:
        with self._lock:
            for digest, url in plan.locations:
                self._locations[digest] = url
                self._locations.move_to_end(digest)
            while len(self._locations) > MAX_LOCATIONS:
                self._locations.popitem(last=False)

    def fetch(self, digest: str, into: memoryview, landed: Callable[[int], None] | None = None) -> ChunkBytes | None:
        with self._lock:
            url = self._locations.get(digest)
        if url is None:
            raise KvcdnError("no URL for it in the load plan")
        if landed is None or not self._reports_landing:
            return self.backend.read_chunk(url, into)
        return self.backend.read_chunk(url, into, landed=landed)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)


Lookup = StoreLookup | IndexLookup


def _takes(function: Any, name: str) -> bool:
    """Whether ``function`` accepts a keyword argument ``name``."""
    import inspect

    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def open_lookup(uri: str, root: str, warn: Callable[[str], None]) -> Lookup:
    """The lookup for the store at ``uri``: the backend's own index when it declares
    ``prefix_lookup``, otherwise the chunk store's index objects."""
    from kvcdn_core import open_storage

    backend = open_storage(uri)
    if backend.offers("prefix_lookup"):
        return IndexLookup(backend, root, warn)
    return StoreLookup(ChunkStore(backend), root, warn)


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
    #: (digest, URL) of the parts, when the source reads them by URL (the hosted service)
    locations: tuple[tuple[str, str], ...] = ()


def plan(record: ArtifactRecord, start: int, end: int, locations: Mapping[str, str] | None = None) -> ChunkPlan:
    """The parts of ``record`` that hold tokens ``[start, end)``, how their bytes are laid out, and
    (from ``locations``) where each is read."""
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
    where = tuple((p.digest, locations[p.digest]) for p in parts if p.digest in locations) if locations else ()
    return ChunkPlan(record.name, tuple(tensors), tuple(parts), where)


def slices(plan: ChunkPlan, got: Sequence[tuple[Part, ChunkBytes]], start: int, end: int) -> dict[str, torch.Tensor]:
    """Each chunked tensor's tokens ``[start, end)`` as ``[outer, end - start, last]``, read from the
    bytes of ``plan``'s parts (``got``: each part with its bytes, in token order)."""
    import torch

    pieces: dict[str, list[torch.Tensor]] = {t.name: [] for t in plan.tensors}
    for part, data in got:
        for name, (begin, stop, dtype, shape) in byte_spans(plan, part).items():
            pieces[name].append(view_bytes(data, dtype, (stop - begin) // dtype.itemsize, begin).view(shape))
    base = got[0][0].start if got else start
    return {name: torch.cat(parts, dim=1)[:, start - base : end - base] for name, parts in pieces.items()}


def byte_spans(plan: ChunkPlan, part: Part) -> dict[str, tuple[int, int, torch.dtype, tuple[int, int, int]]]:
    """Where each chunked tensor lies in ``part``'s bytes (a chunk holds them in plan order):
    ``(begin, end, dtype, [outer, tokens, last])``."""
    import torch

    spans: dict[str, tuple[int, int, torch.dtype, tuple[int, int, int]]] = {}
    offset = 0
    for t in plan.tensors:
        dtype = getattr(torch, t.dtype)
        end = offset + t.outer * part.tokens * t.last * dtype.itemsize
        spans[t.name] = (offset, end, dtype, (t.outer, part.tokens, t.last))
        offset = end
    return spans


def view_bytes(data: ChunkBytes, dtype: torch.dtype, count: int = -1, offset: int = 0) -> torch.Tensor:
    """A tensor over a chunk's bytes: read-only bytes are only read here (sliced, then copied into
    the blocks), so torch's warning about them is not shown."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
