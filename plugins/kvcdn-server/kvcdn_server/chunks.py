"""Chunked artifacts: objects stored once for all tenants, referenced by rows (docs/hosted-api.md).

An artifact uploaded by chunks is its record (``artifacts.record``: the `.kv` header and chunk
plan of :mod:`kvcdn_core.store.record`) plus the objects it names: chunks, pieces and the tail,
each stored once under ``chunks/<digest>`` (BLAKE3 of its bytes) whoever uploaded it. The rows:

- ``chunks``: one per object; ``present`` once a PUT's bytes hashed to the digest and were stored;
- ``artifact_chunks``: the objects an artifact references, written in the transaction that
  creates its upload, removed in the one that deletes it or ends the upload;
- ``tenant_chunks``: the distinct objects a tenant's *ready* artifacts reference. The quota rule:
  a tenant is charged each of them once, however many of its artifacts share it, never for
  another tenant's copies; an open chunked upload reserves the bytes of the objects its tenant
  does not hold yet (``artifacts.charge``).

Races are settled by the ``chunks`` row lock. Whoever touches a chunk's object holds its row
locked while doing so: a PUT stores the bytes and marks the row present in one transaction, and
the collector locks the row, then (in a new statement, so it sees every committed reference)
checks that nothing references it before it deletes the object and the row. A new upload locks
the rows it references (an upsert) before it writes its references and reads which are present,
so it either sees a chunk the collector has already deleted as missing, or holds it before the
collector looks. The confirm reads every object back and checks its digest before it trusts it.

Existence stays secret across tenants: an object is answered present only when the tenant's own
ready artifacts or a public ready artifact reference it; another tenant's private object is
answered missing, exactly as an unknown one, and its PUT is taken (the bytes are equal by digest)
and written again, as a new object's is, so that it takes as long (:meth:`ChunkObjects.accept`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import sqlalchemy as sa

from kvcdn_core import KvcdnError
from kvcdn_core.store import pack
from kvcdn_core.store.record import ArtifactRecord
from kvcdn_server.db import artifact_chunks, artifacts, chunks, tenant_chunks, usage
from kvcdn_server.errors import ApiError, not_found
from kvcdn_server.validation import NotYet, Refused
from kvcdn_wire import ErrorCode

#: prefix of a chunk PUT's temp file in the server's tmp dir (the collector sweeps orphans)
CHUNK_TEMP = ".chunk-"


def object_key(digest: str) -> str:
    return f"chunks/{digest}"


def parse_record(value: dict[str, Any]) -> ArtifactRecord:
    """The record of a chunked upload, checked by core (every field, and against its header)."""
    try:
        return ArtifactRecord.from_json(json.dumps(value).encode(), "record")
    except KvcdnError as exc:
        raise ApiError(422, ErrorCode.INVALID_RECORD, str(exc).splitlines()[0][:300]) from None
    except (RecursionError, ValueError, TypeError, KeyError, AttributeError):
        raise ApiError(422, ErrorCode.INVALID_RECORD, "record: not a valid chunked record") from None


def stored_record(text: str) -> ArtifactRecord:
    """An artifact row's record (written by this server from a record :func:`parse_record` checked),
    without checking its header again: every grant of a lookup reads one."""
    try:
        return ArtifactRecord.from_checked(text)
    except KvcdnError as exc:
        raise ApiError(422, ErrorCode.INVALID_RECORD, str(exc).splitlines()[0][:300]) from None


def objects_of(record: ArtifactRecord) -> dict[str, int]:
    """The distinct objects a record references, ``digest → bytes``; 422 when it gives one
    digest two sizes."""
    found: dict[str, int] = {}
    parts = [(p.digest, p.bytes) for c in record.chunks for p in c.parts]
    parts += [(record.tail.digest, record.tail.bytes)] if record.tail else []
    for digest, size in parts:
        if found.setdefault(digest, size) != size:
            raise ApiError(422, ErrorCode.INVALID_RECORD, f"record: object {digest} is given two sizes")
    return found


def _upsert(c, rows: list[dict[str, Any]]):
    """Insert the ``chunks`` rows that do not exist and lock every one of them (a no-op update)."""
    from sqlalchemy.dialects import postgresql, sqlite

    if c.dialect.name == "postgresql":
        pg = postgresql.insert(chunks).values(rows)
        return pg.on_conflict_do_update(index_elements=["digest"], set_={"digest": pg.excluded.digest})
    lite = sqlite.insert(chunks).values(rows)
    return lite.on_conflict_do_update(index_elements=["digest"], set_={"digest": lite.excluded.digest})


def held(c, tenant: str, digests: list[str]) -> set[str]:
    """Which of ``digests`` count as present for ``tenant``: its own ready artifacts', or a public
    ready artifact's, and stored."""
    found: set[str] = set()
    for start in range(0, len(digests), 500):
        batch = digests[start : start + 500]
        own = sa.select(tenant_chunks.c.digest).where(
            tenant_chunks.c.tenant == tenant, tenant_chunks.c.digest.in_(batch)
        )
        public = (
            sa.select(artifact_chunks.c.digest)
            .join(artifacts, artifacts.c.id == artifact_chunks.c.artifact_id)
            .where(
                artifact_chunks.c.digest.in_(batch), artifacts.c.visibility == "public", artifacts.c.status == "ready"
            )
        )
        stored = set(
            c.execute(sa.select(chunks.c.digest).where(chunks.c.digest.in_(batch), chunks.c.present)).scalars()
        )
        found |= stored & (set(c.execute(own).scalars()) | set(c.execute(public).scalars()))
    return found


def begin(c, tenant: str, artifact_id: str, objects: dict[str, int], now: float) -> tuple[set[str], int]:
    """In the upload's creating transaction: lock (create) the objects' rows, write the upload's
    references; the objects present for this tenant and the bytes to reserve (those it does not
    hold yet)."""
    digests = sorted(objects)  # one lock order for every transaction
    for start in range(0, len(digests), 500):
        batch = digests[start : start + 500]
        c.execute(
            _upsert(c, [{"digest": d, "size_bytes": objects[d], "present": False, "created_at": now} for d in batch])
        )
        c.execute(artifact_chunks.insert(), [{"artifact_id": artifact_id, "digest": d} for d in batch])
    present = held(c, tenant, digests)
    own: set[str] = set()
    for start in range(0, len(digests), 500):
        batch = digests[start : start + 500]
        own |= set(
            c.execute(
                sa.select(tenant_chunks.c.digest).where(
                    tenant_chunks.c.tenant == tenant, tenant_chunks.c.digest.in_(batch)
                )
            ).scalars()
        )
    return present, sum(size for d, size in objects.items() if d not in own)


def referenced(c, artifact_id: str) -> dict[str, int]:
    """``digest → bytes`` of the objects an artifact references (the sizes the record gave)."""
    rows = c.execute(
        sa.select(chunks.c.digest, chunks.c.size_bytes, chunks.c.present)
        .join(artifact_chunks, artifact_chunks.c.digest == chunks.c.digest)
        .where(artifact_chunks.c.artifact_id == artifact_id)
    ).all()
    return {r.digest: r.size_bytes for r in rows}


def make_ready(c, tenant: str, row) -> None:
    """In the confirm's last transaction (the tenant's usage row locked): charge the tenant for
    each object it did not hold yet, and give the upload's reservation back."""
    refs = referenced(c, row.id)
    own = set(c.execute(sa.select(tenant_chunks.c.digest).where(tenant_chunks.c.tenant == tenant)).scalars()) & set(
        refs
    )
    new = {d: s for d, s in refs.items() if d not in own}
    if new:
        c.execute(tenant_chunks.insert(), [{"tenant": tenant, "digest": d, "size_bytes": s} for d, s in new.items()])
    charged = sum(new.values()) - (row.charge or 0)
    c.execute(usage.update().where(usage.c.tenant == tenant).values(bytes=usage.c.bytes + charged))
    c.execute(artifacts.update().where(artifacts.c.id == row.id).values(charge=0))


def drop(c, tenant: str, artifact_id: str, was_ready: bool) -> int:
    """In the transaction that removes an artifact (or ends its upload): remove its references and,
    when it was ready, the tenant's hold on objects no other ready artifact of it references.
    Returns the bytes those held (the caller gives them back)."""
    digests = list(
        c.execute(sa.select(artifact_chunks.c.digest).where(artifact_chunks.c.artifact_id == artifact_id)).scalars()
    )
    c.execute(artifact_chunks.delete().where(artifact_chunks.c.artifact_id == artifact_id))
    if not was_ready or not digests:
        return 0
    freed = 0
    for start in range(0, len(digests), 500):
        batch = digests[start : start + 500]
        still = set(
            c.execute(
                sa.select(artifact_chunks.c.digest)
                .join(artifacts, artifacts.c.id == artifact_chunks.c.artifact_id)
                .where(
                    artifact_chunks.c.digest.in_(batch),
                    artifacts.c.tenant == tenant,
                    artifacts.c.status == "ready",
                    artifacts.c.id != artifact_id,
                )
            ).scalars()
        )
        gone = [d for d in batch if d not in still]
        if gone:
            freed += int(
                c.execute(
                    sa.select(sa.func.coalesce(sa.func.sum(tenant_chunks.c.size_bytes), 0)).where(
                        tenant_chunks.c.tenant == tenant, tenant_chunks.c.digest.in_(gone)
                    )
                ).scalar_one()
            )
            c.execute(tenant_chunks.delete().where(tenant_chunks.c.tenant == tenant, tenant_chunks.c.digest.in_(gone)))
    return freed


class ChunkObjects:
    """The chunk objects of one store: PUT, read back, rebuild, collect."""

    def __init__(self, store):
        self.store = store

    # -- PUT -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def temp_file(self) -> Iterator[Path]:
        """A temp file for a PUT's bytes, marked in use (the collector leaves it alone)."""
        store = self.store
        store.tmp_dir.mkdir(parents=True, exist_ok=True)
        with store._using_lock:
            fd, name = tempfile.mkstemp(prefix=CHUNK_TEMP, dir=store.tmp_dir)
            store._using.add(Path(name))
        os.close(fd)
        try:
            yield Path(name)
        finally:
            Path(name).unlink(missing_ok=True)
            store._done_using(Path(name))

    def accept(self, digest: str, size: int, path: Path) -> None:
        """Store a received object whose bytes hashed to ``digest``, under its row's lock; 404 when no
        upload references it (its row is gone).

        The object is written every time, even when it is stored already: skipping the write for
        bytes another tenant holds would answer such a PUT faster than one of new bytes, a timing
        oracle for "someone holds this chunk". The write is idempotent (equal digest, equal bytes)
        and atomic (a reader sees the old object or the new one, both the same bytes)."""
        store = self.store
        with store.db.begin() as c:
            row = c.execute(sa.select(chunks).where(chunks.c.digest == digest).with_for_update()).first()
            if row is None:
                raise not_found()
            if store.local:
                target = store.storage.path_of(object_key(digest))
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
            else:
                store.storage.put_file(object_key(digest), path)
            c.execute(chunks.update().where(chunks.c.digest == digest).values(present=True, size_bytes=size))

    # -- confirm ---------------------------------------------------------------------------------

    def fetch(self, digest: str, size: int) -> bytes:
        """An object's bytes, checked against its digest and size (:func:`pack.checked`)."""
        return pack.checked(self.store.storage.read_bytes(object_key(digest)), digest, size, "chunked upload")

    def check_present(self, row) -> None:
        """Every object the upload references is stored with its size; else :class:`NotYet` (409),
        marking the ones whose bytes are gone as missing, so that a new upload asks for them."""
        with self.store.reads.connect() as c:
            refs = c.execute(
                sa.select(chunks.c.digest, chunks.c.size_bytes, chunks.c.present)
                .join(artifact_chunks, artifact_chunks.c.digest == chunks.c.digest)
                .where(artifact_chunks.c.artifact_id == row.id)
            ).all()
        record = ArtifactRecord.from_json(row.record.encode(), "record")
        wanted = objects_of(record)
        missing = [r.digest for r in refs if not r.present or self.store.storage.size_of(object_key(r.digest)) is None]
        lost = [r.digest for r in refs if r.present and r.digest in missing]
        if lost:
            with self.store.db.begin() as c:
                c.execute(chunks.update().where(chunks.c.digest.in_(lost)).values(present=False))
        if missing or len(refs) != len(wanted):
            raise NotYet(
                ApiError(
                    409,
                    ErrorCode.UPLOAD_INCOMPLETE,
                    f"{max(len(missing), 1)} object(s) of this upload are not uploaded yet",
                )
            )
        for r in refs:
            if wanted.get(r.digest) != r.size_bytes:
                raise Refused(
                    422,
                    ErrorCode.SIZE_MISMATCH,
                    f"object {r.digest} has {r.size_bytes} bytes, not {wanted.get(r.digest)}",
                )

    @contextlib.contextmanager
    def rebuilt(self, row) -> Iterator[Path]:
        """The artifact's `.kv` file rebuilt from its objects (each checked against its digest) in a
        temp dir, removed on exit (by the collector after a crash)."""
        store = self.store
        store.tmp_dir.mkdir(parents=True, exist_ok=True)
        import shutil

        from kvcdn_server.uploads import COPY_PREFIX

        with store._using_lock:
            tmp = Path(tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{row.id}-", dir=store.tmp_dir))
            store._using.add(tmp)
        try:
            record = ArtifactRecord.from_json(row.record.encode(), "record")
            target = tmp / "object.kv"
            pack.rebuild(record, self.fetch, target)
            yield target
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            store._done_using(tmp)

    # -- collection ------------------------------------------------------------------------------

    def collect(self) -> int:
        """Delete every object no artifact (ready, or a live upload) references; returns how many
        (:meth:`orphans`, then :meth:`remove_unreferenced` for each)."""
        return sum(self.remove_unreferenced(digest) for digest in self.orphans())

    def orphans(self) -> list[str]:
        """The objects no artifact references now (a snapshot: each is looked at again)."""
        orphan = sa.select(chunks.c.digest).where(~sa.exists().where(artifact_chunks.c.digest == chunks.c.digest))
        with self.store.reads.connect() as c:
            return list(c.execute(orphan).scalars())

    def remove_unreferenced(self, digest: str) -> bool:
        """Delete the object and its row when nothing references it, under the row's lock: the row
        is locked first, then a new statement looks for references (it sees every reference
        committed meanwhile), then the object goes, then the row, in one transaction. A collector
        that dies between the two leaves a row marked present without its object: no artifact
        references it, and a confirm reads every object back."""
        store = self.store
        with store.db.begin() as c:
            locked = sa.select(chunks.c.digest).where(chunks.c.digest == digest).with_for_update()
            if c.execute(locked).first() is None:
                return False
            refs = sa.select(artifact_chunks.c.digest).where(artifact_chunks.c.digest == digest).limit(1)
            if c.execute(refs).first() is not None:
                return False
            store.storage.delete(object_key(digest))
            c.execute(chunks.delete().where(chunks.c.digest == digest))
        return True


def blake3_of(path: Path) -> str:
    digest = blake3.blake3()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
