"""A chunk store in any storage backend: put, get, delete, list, garbage-collect and check artifacts.

Objects under the store's root (docs/store.md):

- ``chunks/<d[:2]>/<d>``: a chunk's (a piece's, a tail's) bytes, named by their BLAKE3 digest ``d``;
  written once, a put that finds it present skips it (dedup);
- ``artifacts/<name>.json``: an artifact's record (:mod:`kvcdn_core.store.record`);
- ``pending/<id>.json``: a put in progress: when it started and every digest it will reference;
- ``trash/<run>/<d>``: chunks a running GC took out of ``chunks/`` and has not yet decided on.

Crash and concurrency rules, with no lock and no read-modify-write of a shared object:

- A put writes its pending marker before it looks for any chunk, uploads the missing chunks,
  writes its record, then checks that every chunk it references is still in ``chunks/`` and puts
  back any that is not (it still has the file), then removes its marker. A reader that finds a
  record therefore finds its chunks, once the put has returned.
- GC lists records and live pending markers, moves every chunk none references into its own
  ``trash/<run>/``, lists records and markers *again*, moves back what is referenced now and
  deletes the rest. A chunk leaves ``chunks/`` only by that move, and a put's final check runs
  after its record is written: either the GC's second listing sees the record (the chunk comes
  back) or the put's check runs after the move (the put uploads it again). A marker older than
  :data:`PENDING_TTL` is a put that died (kill -9): it protects nothing and is removed. A GC that
  died leaves ``trash/``: the next GC restores what is referenced and deletes the rest.

No torch here; numpy only where bytes are cut or rebuilt (:mod:`kvcdn_core.store.pack`), imported
when a put or get needs it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvcdn_core.contracts.storage import ObjectNotFound, StorageBackend
from kvcdn_core.errors import KvcdnError
from kvcdn_core.store.record import HEX64, NAME, ArtifactRecord, PieceRef

CHUNKS = "chunks/"
ARTIFACTS = "artifacts/"
PENDING = "pending/"
TRASH = "trash/"
#: A pending marker older than this (seconds) belongs to a put that died; its chunks become
#: reclaimable. A day: longer than any put of one artifact, however slow the link.
PENDING_TTL = 24 * 3600.0
#: Parsed records a store keeps, each with the bytes it was parsed from. A record is read at every
#: use (an engine's scheduler reads the hit's at every request), and parsing it (the ``.kv`` header,
#: checked against the chunk plan) costs about 1 ms for a 30-layer model against 8 µs for the read
#: from the page cache: the kept one serves when the bytes read are the same.
KEPT_RECORDS = 64


def chunk_key(digest: str) -> str:
    return f"{CHUNKS}{digest[:2]}/{digest}"


def record_key(name: str) -> str:
    return f"{ARTIFACTS}{name}.json"


def check_name(name: str) -> str:
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise KvcdnError(
            f"invalid artifact name {name!r}: use 1-128 letters, digits, '.', '_' or '-', not starting with '.', '_' or '-'"
        )
    return name


@dataclasses.dataclass
class PutReport:
    name: str
    tokens: int
    file_bytes: int
    chunks: int
    chunks_new: int
    chunks_shared: int
    #: chunks made of pieces: a stored shorter chunk that is a token-prefix of it, then the rest
    chunks_pieced: int
    #: bytes uploaded: new chunks and pieces, the tail when new, and the record
    bytes_moved: int
    #: bytes not uploaded because the store already held them (dedup)
    bytes_saved: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GetReport:
    name: str
    path: str
    file_bytes: int
    bytes_fetched: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GcReport:
    records: int
    chunks_kept: int
    chunks_deleted: int
    bytes_reclaimed: int
    pending_live: int
    pending_expired: int
    restored: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CheckReport:
    records: int
    chunks: int
    chunk_bytes: int
    orphans: int
    orphan_bytes: int
    pending: int
    trash: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": "OK" if self.ok else "FAILED"}


@dataclasses.dataclass
class Listed:
    """One artifact of :meth:`ChunkStore.listing`."""

    name: str
    tokens: int
    chunks: int
    shared_chunks: int
    bytes: int
    file_bytes: int
    reuse: str
    model: str | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ChunkStore:
    """Artifacts as chunks and records in ``backend`` (any :class:`StorageBackend` that stores bytes).

    ``clock`` (seconds, like :func:`time.time`) stamps pending markers and decides which expired.
    """

    def __init__(
        self,
        backend: StorageBackend,
        clock: Callable[[], float] = time.time,
        pending_ttl: float = PENDING_TTL,
        chunk_tokens: int | None = None,
        pieces: bool = True,
    ):
        if type(backend).stores != "bytes":  # declared by the storage contract
            raise KvcdnError(f"{backend!r} keeps only .kv artifacts; a chunk store needs a backend that stores bytes")
        self.backend = backend
        self.clock = clock
        self.pending_ttl = pending_ttl
        #: tokens per chunk of the puts (None: :data:`kvcdn_core.store.keys.CHUNK_TOKENS`); a
        #: store mixing sizes stays correct (each record says its own) but shares nothing across them
        self.chunk_tokens = chunk_tokens
        #: whether a put builds a chunk on a stored token-prefix of it (pieces); off only to measure
        self.pieces = pieces
        self._records: collections.OrderedDict[str, tuple[bytes, ArtifactRecord]] = collections.OrderedDict()
        self._records_lock = threading.Lock()

    # -- records -----------------------------------------------------------------------------------

    def record(self, name: str) -> ArtifactRecord:
        """The record of ``name`` as stored now: read every time, parsed only when its bytes changed."""
        key = record_key(check_name(name))
        data = self.backend.read_bytes(key)
        if data is None:
            raise KvcdnError(f"no artifact '{name}' in the store")
        with self._records_lock:
            kept = self._records.get(key)
            if kept is not None and kept[0] == data:
                self._records.move_to_end(key)
                return kept[1]
        record = ArtifactRecord.from_json(data, f"record '{name}'")
        with self._records_lock:
            self._records[key] = (bytes(data), record)
            self._records.move_to_end(key)
            while len(self._records) > KEPT_RECORDS:
                self._records.popitem(last=False)
        return record

    def names(self) -> list[str]:
        found = []
        for info in self.backend.list(ARTIFACTS):
            stem = info.key[len(ARTIFACTS) :]
            if stem.endswith(".json") and "/" not in stem:
                found.append(stem[: -len(".json")])
        return found

    def records(self, on_error: Callable[[str], None] | None = None) -> list[ArtifactRecord]:
        """Every record, by name. A bad one raises, or with ``on_error`` is reported and skipped; one
        deleted between the listing and its read (a concurrent delete) is not there."""
        found = []
        for name in self.names():
            data = self.backend.read_bytes(record_key(name))
            if data is None:  # deleted since the listing: gone, not damaged
                continue
            try:
                found.append(ArtifactRecord.from_json(data, f"record '{name}'"))
            except KvcdnError as exc:
                if on_error is None:
                    raise
                on_error(str(exc))
        return found

    def token_ids(self, name: str) -> list[int]:
        """An artifact's token ids, read from its tail (they are never cut into chunks)."""
        from kvcdn_core import artifact
        from kvcdn_core.store import pack

        record = self.record(name)
        header = record.parsed_header()
        entry = header.entries[artifact.TOKEN_IDS]
        offset = 0
        for tensor in pack.tail_names(header, record.chunked):
            if tensor == artifact.TOKEN_IDS:
                break
            start, end = header.entries[tensor]["data_offsets"]
            offset += end - start
        if record.tail is None:  # only an artifact of no tokens has no tail bytes
            return []
        tail = self._fetch(record.tail.digest, record.tail.bytes, name)
        start, end = entry["data_offsets"]
        import numpy as np

        dtype = "<i8" if entry["dtype"] == "I64" else "<i4"
        return np.frombuffer(tail, dtype=dtype, count=(end - start) // np.dtype(dtype).itemsize, offset=offset).tolist()

    # -- put ---------------------------------------------------------------------------------------

    def put(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        force: bool = False,
        verified: bool = False,
        settled: int | None = None,
    ) -> PutReport:
        """Store the `.kv` file at ``path`` as ``name`` (default: the file's stem).

        Cutting the file reads and hashes each byte once (:meth:`pack.Cutter.plan`); only the
        chunks the store lacks are read and hashed again, as they are uploaded. Before that, the
        file's tensors are checked against its manifest's digests, unless ``verified``: the caller
        wrote the file itself, from tensors it has just hashed (the vLLM connector's saves), and a
        second pass over every byte would prove nothing new. ``settled``: the rows of later tokens
        may come back other bits in a longer artifact of the same tokens (an engine recomputes a
        prompt's last, partial block in the next turn), so the last chunk's new bytes are cut into
        two pieces there and that artifact can reference the first.
        """
        from kvcdn_core import artifact
        from kvcdn_core.store import keys, pack

        path = Path(path)
        name = check_name(name if name is not None else pack.file_stem(path))
        if not force and self.backend.exists(record_key(name)):
            raise KvcdnError(f"artifact '{name}' exists in the store; pass --force to replace it")
        header = artifact.read_header(path)
        ids = artifact.read_token_ids(path, header)
        cutter = pack.Cutter(header, ids, self.chunk_tokens or keys.CHUNK_TOKENS)
        if not verified:
            cutter.check_digests()  # a store keeps only what the file's manifest promises

        def present(digest: str) -> bool:
            return self.backend.exists(chunk_key(digest))

        plan = cutter.plan(self._stored_prefix(cutter, ids), present, settled)
        marker = f"{PENDING}{uuid.uuid4().hex}.json"
        stamp = {"created": self.clock(), "name": name, "digests": sorted({b.digest for b in plan.blobs})}
        self.backend.write_bytes(marker, json.dumps(stamp).encode())
        try:
            moved = saved = 0
            seen: set[str] = set()
            new_chunks: set[int] = set()
            for blob in plan.blobs:
                if blob.digest in seen or present(blob.digest):
                    saved += blob.size
                    continue
                self.backend.write_bytes(
                    chunk_key(blob.digest), pack.checked(blob.gather(), blob.digest, blob.size, name)
                )
                seen.add(blob.digest)
                moved += blob.size
                if blob.chunk is not None:
                    new_chunks.add(blob.chunk)
            old = self._old_record(name) if force else None
            record = pack.record_for(name, path, header, cutter, plan)
            body = record.to_json()
            self.backend.write_bytes(record_key(name), body)
            moved += len(body)
            for blob in plan.blobs:  # a GC may have taken an object we found present: put it back
                if not present(blob.digest):
                    self.backend.write_bytes(
                        chunk_key(blob.digest), pack.checked(blob.gather(), blob.digest, blob.size, name)
                    )
                    moved += blob.size
            from kvcdn_core.store import index

            if old is not None:
                index.remove(self.backend, old[0], old[1])
            index.add(self.backend, record, ids)
        finally:
            self.backend.delete(marker)
        chunks = len(record.chunks)
        pieced = sum(1 for c in record.chunks if c.pieces)
        new = len(new_chunks)
        return PutReport(name, header.token_count, header.file_size, chunks, new, chunks - new, pieced, moved, saved)

    def _stored_prefix(self, cutter, ids: list[int]) -> dict[int, tuple[PieceRef, ...]]:
        """The pieces of the stored artifact sharing the longest prefix with ``ids``, for each of
        its chunks that starts inside that prefix (:meth:`pack.Cutter.plan` checks their bytes).

        One index lookup and one record read. An unreadable index or record only means no reuse:
        the chunks are stored whole, as they would be without it.
        """
        from kvcdn_core.store import index

        if not self.pieces or not cutter.chain:
            return {}
        try:
            hits = index.lookup(self.backend, cutter.root, ids, limit=1)
            other = self.record(hits[0].name) if hits else None
        except KvcdnError:
            return {}
        return prefix_parts(cutter, other, hits[0].prefix_tokens if hits else 0)

    def _old_record(self, name: str) -> tuple[ArtifactRecord, list[int]] | None:
        try:
            return self.record(name), self.token_ids(name)
        except KvcdnError:
            return None

    # -- get ---------------------------------------------------------------------------------------

    def _fetch(self, digest: str, size: int, name: str) -> bytes:
        from kvcdn_core.store import pack

        return pack.checked(self.backend.read_bytes(chunk_key(digest)), digest, size, f"artifact '{name}'")

    def get(self, name: str, target: str | os.PathLike[str]) -> GetReport:
        """Rebuild artifact ``name`` as the `.kv` file ``target`` (atomically), every chunk checked."""
        from kvcdn_core.store import pack

        record = self.record(name)
        fetched = pack.rebuild(record, lambda d, size: self._fetch(d, size, name), Path(target))
        return GetReport(name, str(target), record.size, fetched)

    # -- delete ------------------------------------------------------------------------------------

    def delete(self, name: str) -> ArtifactRecord:
        """Remove an artifact's record, then its index entries; GC reclaims its chunks."""
        from kvcdn_core.store import index

        record = self.record(name)
        ids = self.token_ids(name)
        self.backend.delete(record_key(name))
        index.remove(self.backend, record, ids)
        return record

    def rebuild_index(self) -> int:
        """Rebuild the prefix index from the records (a put or delete that died between its record
        and its index entry); returns how many artifacts it holds."""
        from kvcdn_core.store import index

        return index.rebuild(self.backend, ((rec, self.token_ids(rec.name)) for rec in self.records()))

    # -- listing -----------------------------------------------------------------------------------

    def listing(self, on_error: Callable[[str], None] | None = None) -> list[Listed]:
        """Every artifact with its chunks and how many of them share an object (the chunk whole, or
        one of its pieces) with another artifact."""
        return listed(self.records(on_error))

    def chunk_table(self, name: str) -> tuple[ArtifactRecord, list[dict[str, Any]]]:
        """An artifact's objects, in token order: each chunk whole or its pieces (``chunk``: the
        chunk's index), then the tail, each with how many other artifacts reference it."""
        record = self.record(name)
        return record, chunk_rows(record, [r for r in self.records(on_error=lambda _msg: None) if r.name != name])

    # -- garbage collection ------------------------------------------------------------------------

    def _pending(self, now: float) -> tuple[set[str], list[str], list[str]]:
        """Digests live markers protect, live marker keys, expired (or unreadable) marker keys."""
        protected: set[str] = set()
        live, expired = [], []
        for info in self.backend.list(PENDING):
            data = self.backend.read_bytes(info.key)
            marker = _marker(data)
            if marker is None:
                if data is not None:
                    expired.append(info.key)
                continue
            created, digests = marker
            if now - created >= self.pending_ttl:
                expired.append(info.key)
            else:
                live.append(info.key)
                protected.update(digests)
        return protected, live, expired

    def _referenced(self) -> tuple[set[str], int]:
        def refuse(message: str) -> None:
            raise KvcdnError(f"gc refused: {message}; fix or remove that record first (kvcdn store check)")

        records = self.records(on_error=refuse)
        return {d for r in records for d in r.digests}, len(records)

    def _move(self, source: str, target: str) -> None:
        """Rename an object, or copy and delete it on a backend without rename (a chunk is small)."""
        if "rename" not in type(self.backend).unsupported:
            self.backend.rename(source, target)
            return
        data = self.backend.read_bytes(source)
        if data is None:
            raise ObjectNotFound(f"no object '{source}'")
        self.backend.write_bytes(target, data)
        self.backend.delete(source)

    def gc(self, now: float | None = None) -> GcReport:
        """Delete every chunk no record and no live pending marker references (see the module doc)."""
        now = self.clock() if now is None else now
        run = uuid.uuid4().hex
        referenced, _ = self._referenced()
        protected, _, _ = self._pending(now)
        keep = referenced | protected
        moved: list[tuple[str, str]] = []  # (trash key, digest)
        for info in self.backend.list(TRASH):  # left by a GC that died: decided below with ours
            digest = info.key.rsplit("/", 1)[-1]
            if HEX64.fullmatch(digest):
                moved.append((info.key, digest))
        sizes: dict[str, int] = {}
        for info in self.backend.list(CHUNKS):
            digest = info.key.rsplit("/", 1)[-1]
            if not HEX64.fullmatch(digest) or info.key != chunk_key(digest) or digest in keep:
                continue
            trash = f"{TRASH}{run}/{digest}"
            try:
                self._move(info.key, trash)
            except ObjectNotFound:  # another GC took it first
                continue
            moved.append((trash, digest))
            sizes[digest] = info.size
        # Second look: a record or a put that appeared meanwhile gets its chunks back.
        referenced, records = self._referenced()
        protected, live, expired = self._pending(now)
        keep = referenced | protected
        deleted = reclaimed = restored = 0
        for trash, digest in moved:
            if digest in keep:
                try:
                    self._move(trash, chunk_key(digest))
                    restored += 1
                except ObjectNotFound:
                    pass
            else:
                size = sizes.get(digest) or self.backend.size_of(trash) or 0
                self.backend.delete(trash)
                deleted += 1
                reclaimed += size
        for key in expired:
            self.backend.delete(key)
        kept = len({d for d in referenced})
        return GcReport(records, kept, deleted, reclaimed, len(live), len(expired), restored)

    # -- check -------------------------------------------------------------------------------------

    def check(self, now: float | None = None) -> CheckReport:
        """Every chunk against its digest, every record's references; orphans counted (GC's work)."""
        from kvcdn_core.artifact.digests import hexdigest

        now = self.clock() if now is None else now
        problems: list[str] = []
        chunks: dict[str, int] = {}
        for info in self.backend.list(CHUNKS):
            digest = info.key.rsplit("/", 1)[-1]
            if not HEX64.fullmatch(digest) or info.key != chunk_key(digest):
                problems.append(f"foreign object '{info.key}' under {CHUNKS}")
                continue
            data = self.backend.read_bytes(info.key)
            if data is None:  # deleted meanwhile (a GC)
                continue
            if hexdigest("blake3", data) != digest:
                problems.append(f"chunk {digest} is corrupted (its bytes do not hash to its name)")
            chunks[digest] = len(data)
        records = self.records(on_error=problems.append)
        referenced: set[str] = set()
        for r in records:
            refs = [(p.digest, p.bytes) for c in r.chunks for p in c.parts]
            refs += [(r.tail.digest, r.tail.bytes)] if r.tail else []
            for digest, size in refs:
                referenced.add(digest)
                if digest not in chunks:
                    problems.append(f"artifact '{r.name}' references missing chunk {digest}")
                elif chunks[digest] != size:
                    problems.append(
                        f"artifact '{r.name}' expects {size} bytes of chunk {digest}, it has {chunks[digest]}"
                    )
        for r in records:
            if r.chunks and all(d in chunks for d in r.digests):
                problem = self._key_problem(r)
                if problem:
                    problems.append(problem)
        protected, live, _ = self._pending(now)
        orphans = {d: s for d, s in chunks.items() if d not in referenced and d not in protected}
        trash = len(self.backend.list(TRASH))
        return CheckReport(
            len(records),
            len(chunks),
            sum(chunks.values()),
            len(orphans),
            sum(orphans.values()),
            len(live),
            trash,
            problems,
        )

    def _key_problem(self, record: ArtifactRecord) -> str | None:
        """What is wrong with a record's root and chain keys, if anything: they must be those of its
        header (model, representation) and token ids, since the prefix index trusts them."""
        from kvcdn_core.artifact.manifest import manifest_of
        from kvcdn_core.store import keys, pack

        if record.root != pack.root_of(manifest_of(record.parsed_header()), record.chunk_tokens):
            return f"artifact '{record.name}': its root key is not that of its model and representation"
        try:
            ids = self.token_ids(record.name)
        except KvcdnError as exc:
            return str(exc)
        if [c.key for c in record.chunks] != keys.chain(record.root, ids, record.chunk_tokens):
            return f"artifact '{record.name}': its chunk keys are not those of its token ids"
        return None


def _marker(data: bytes | None) -> tuple[float, list[str]] | None:
    """A pending marker's (created, digests), or None when it is not one."""
    if data is None or len(data) > 1 << 24:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    created, digests = value.get("created"), value.get("digests")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        return None
    if not (isinstance(digests, list) and all(isinstance(d, str) and HEX64.fullmatch(d) for d in digests)):
        return None
    return float(created), digests


def stored_bytes(backend: StorageBackend, prefixes: Iterable[str] = (CHUNKS, ARTIFACTS)) -> int:
    """Bytes the store's objects take (chunks and records by default)."""
    return sum(info.size for prefix in prefixes for info in backend.list(prefix))


def open_chunk_store(backend: StorageBackend) -> Any:
    """The chunk store on ``backend``: its own when it declares ``chunk_store`` (the hosted
    endpoint), else a :class:`ChunkStore` on its bytes."""
    return backend.chunk_store() if type(backend).offers("chunk_store") else ChunkStore(backend)


def listed(records: list[ArtifactRecord]) -> list[Listed]:
    """``records`` as listing rows, each with how many of its chunks share an object (the chunk
    whole, or one of its pieces) with another of them."""
    users = collections.Counter(d for r in records for d in set(r.digests))
    return [
        Listed(
            r.name,
            r.token_count,
            len(r.chunks),
            sum(1 for c in r.chunks if any(users[p.digest] > 1 for p in c.parts)),
            r.stored_bytes,
            r.size,
            r.reuse,
            r.model.get("id"),
        )
        for r in records
    ]


def prefix_parts(cutter, other: ArtifactRecord | None, prefix: int) -> dict[int, tuple[PieceRef, ...]]:
    """The candidates :meth:`pack.Cutter.plan` takes from ``other``, a stored artifact whose first
    ``prefix`` tokens are the file's: the parts (pieces, or itself whole) of each of its chunks that
    starts inside that prefix. None when ``other`` is missing or cut on another chain (root or chunk
    size). The hosted client uses it too (:mod:`kvcdn_hosted.chunked`)."""
    if other is None or other.root != cutter.root or other.chunk_tokens != cutter.chunk_tokens:
        return {}
    return {i: c.parts for i, c in enumerate(other.chunks) if i * other.chunk_tokens < prefix}


def chunk_rows(record: ArtifactRecord, others: list[ArtifactRecord]) -> list[dict[str, Any]]:
    """``record``'s objects in token order: each chunk whole or its pieces (``chunk``: the chunk's
    index), then the tail, each with how many of ``others`` reference it."""
    counts: collections.Counter[str] = collections.Counter()
    for r in others:
        counts.update(set(r.digests))
    rows: list[dict[str, Any]] = []
    first = 0
    for i, c in enumerate(record.chunks):
        for p in c.parts:
            rows.append(
                {
                    "chunk": i,
                    "tokens": [first, first + p.tokens],
                    "key": c.key,
                    "digest": p.digest,
                    "bytes": p.bytes,
                    "shared_with": counts[p.digest],
                }
            )
            first += p.tokens
    if record.tail:
        rows.append(
            {
                "chunk": None,
                "tokens": None,
                "key": None,
                "digest": record.tail.digest,
                "bytes": record.tail.bytes,
                "shared_with": counts[record.tail.digest],
            }
        )
    return rows
