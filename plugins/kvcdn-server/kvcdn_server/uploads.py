"""The upload state machine: upload-url, the PUT, confirm and delete, each a move of one row.

Every change of an upload's state is one conditional UPDATE (``... WHERE status IN (...)``), so two
requests or two replicas can never both move the same upload; quota is reserved at upload-url
(:mod:`kvcdn_server.quota`) and given back when an upload fails, expires or is deleted. The states
are documented in docs/hosted-api.md.

Work that takes long (a PUT, a confirm) holds a *lease* on its row, renewed by a heartbeat. Only a
refusal (the bytes are wrong, :mod:`kvcdn_server.validation`) fails an upload; work that stops for
any other reason (the database or the object store went away, the server died) hands the upload
back to where it was, so that a retry succeeds: at once when the work can still say so, else when
its lease runs out (:mod:`kvcdn_server.collector`). Objects are deleted only after the database
says they are dead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kvcdn_core import KvcdnError, StorageBackend
from kvcdn_server import chunks, prefix
from kvcdn_server.db import artifacts, readers
from kvcdn_server.errors import ApiError, database_unavailable, is_database_outage, not_found
from kvcdn_server.quota import Quota
from kvcdn_server.rows import LIVE, OPEN, artifact_key, upload_key, view
from kvcdn_server.validation import NotYet, Refused, check_file, check_id, check_upload
from kvcdn_wire import ErrorCode

log = logging.getLogger("kvcdn.server.store")
#: The server's temp files are named for their upload, so the collector can tell whose they are:
#: a PUT in progress streams to ``.put-<id>-<random>`` (next to the objects on local storage, else in
#: the server's tmp dir), and a local copy of an S3 object (checked at confirm, loaded for inference)
#: is the directory ``.copy-<id>-<random>`` in the tmp dir.
TEMP_PREFIX = ".put-"
COPY_PREFIX = ".copy-"
#: the state whose live lease keeps a temp file of each kind
TEMP_OWNER = {TEMP_PREFIX: "uploading", COPY_PREFIX: "confirming"}
#: the ``error`` of an upload whose confirm was interrupted once (handed back); a second interruption
#: fails it, so that a file that kills the server checking it cannot do so again and again
INTERRUPTED = "its confirm was interrupted"


class Uploads:
    """The uploads and artifacts of all tenants: rows in the database, bytes in ``storage``."""

    def __init__(self, db_engine: sa.Engine, storage: StorageBackend, config, clock: Callable[[], float] = time.time):
        #: the wall clock of every expiry and lease (seconds since the epoch); a test passes one it
        #: advances itself, so that expiry is tested without sleeping
        self.clock = clock
        #: when this process last failed to reach the database: leases are not judged for a lease
        #: period after it, so that holders whose heartbeats could not get through renew them first
        self.outage_at = float("-inf")
        self.db = db_engine
        self.reads = readers(db_engine)
        self.storage = storage
        self.config = config
        #: objects are files here (the storage declares ``local_path``): PUTs land next to them
        self.local = type(storage).offers("local_path")
        self.tmp_dir = Path(config.home) / "tmp"
        # temp files this process is using: the collector leaves them alone, whatever their age
        self._using: set[Path] = set()
        self._using_lock = threading.Lock()
        self.quota = Quota(db_engine, self.reads, config)
        #: the objects of chunked artifacts (stored once for all tenants)
        self.objects = chunks.ChunkObjects(self)

    # -- lookups ---------------------------------------------------------------------------

    def row(self, artifact_id: str, conn: sa.Connection | None = None):
        """The artifact's row, read on ``conn`` when given (a caller that holds a read connection)."""
        if conn is not None:
            return conn.execute(sa.select(artifacts).where(artifacts.c.id == artifact_id)).first()
        with self.reads.connect() as c:
            return self.row(artifact_id, c)

    def readable(self, tenant: str | None, artifact_id: str, conn: sa.Connection | None = None):
        """The caller's own artifact (any live state) or anyone's ready public one; else 404."""
        check_id(artifact_id)
        row = self.row(artifact_id, conn)
        if row is None or row.status not in LIVE:
            raise not_found()
        if tenant is not None and row.tenant == tenant:
            return row
        if row.visibility == "public" and row.status == "ready":
            return row
        raise not_found()

    def ready_row(self, artifact_id: str):
        row = self.row(artifact_id)
        return row if row is not None and row.status == "ready" else None

    def list_ready(
        self, tenant: str, limit: int, cursor: str | None, prefix: str = ""
    ) -> tuple[list[dict], str | None]:
        """One page of the tenant's ready artifacts (those whose name starts with ``prefix``), by id."""
        query = (
            sa.select(artifacts)
            .where(artifacts.c.tenant == tenant, artifacts.c.status == "ready")
            .order_by(artifacts.c.id)
            .limit(limit + 1)
        )
        if prefix:
            # substr, not LIKE: exact in both databases (SQLite's LIKE ignores case)
            query = query.where(sa.func.substr(artifacts.c.name, 1, len(prefix)) == prefix)
        if cursor is not None:
            query = query.where(artifacts.c.id > cursor)
        with self.reads.connect() as c:
            rows = c.execute(query).all()
        page = [view(r) for r in rows[:limit]]
        return page, (rows[limit - 1].id if len(rows) > limit else None)

    # -- state changes -----------------------------------------------------------------------

    def _move(self, c, artifact_id: str, frm: tuple[str, ...], to: str, **values) -> bool:
        """One conditional state change; true when this caller made it."""
        now = self.clock()
        result = c.execute(
            artifacts.update()
            .where(artifacts.c.id == artifact_id, artifacts.c.status.in_(frm))
            .values(status=to, updated_at=now, **values)
        )
        return result.rowcount == 1

    def end(self, artifact_id: str, frm: tuple[str, ...], to: str, error: str | None = None) -> bool:
        """Move an upload to ``failed``/``expired`` and give its reservation back, in one transaction;
        then remove its bytes (only after the database says they are dead)."""
        with self.db.begin() as c:
            row = c.execute(
                sa.select(
                    artifacts.c.tenant, artifacts.c.size_bytes, artifacts.c.multipart_id, artifacts.c.charge
                ).where(artifacts.c.id == artifact_id)
            ).first()
            if row is None or not self._move(c, artifact_id, frm, to, error=error, lease_until=None):
                return False
            self._release(c, row, artifact_id, was_ready="ready" in frm)
        self._remove_objects(artifact_id, row.multipart_id)
        return True

    def _release(self, c, row, artifact_id: str, was_ready: bool) -> None:
        """Give back what a row held in its tenant's usage, in the transaction that ends it: a
        whole file its size; an open chunked upload its reservation; a ready chunked artifact the
        objects no other ready artifact of its tenant references (:func:`chunks.drop`)."""
        prefix.drop_artifact(c, artifact_id)
        if row.charge is None:
            self.quota.release(c, row.tenant, row.size_bytes)
            return
        freed = chunks.drop(c, row.tenant, artifact_id, was_ready)
        self.quota.release(c, row.tenant, freed + (0 if was_ready else row.charge))

    def _remove_objects(self, artifact_id: str, multipart_id: str | None = None) -> None:
        if multipart_id and type(self.storage).offers("multipart"):
            with contextlib.suppress(Exception):
                self.storage.abort_multipart(upload_key(artifact_id), multipart_id)
        for key in (upload_key(artifact_id), artifact_key(artifact_id)):
            try:
                self.storage.delete(key)
            except Exception:  # the collector tries again later
                log.warning("could not delete the objects of %s yet", artifact_id)

    @contextlib.contextmanager
    def lease(self, artifact_id: str, status: str):
        """Renew the row's lease while the body runs, so the collector knows its server is alive."""
        stop = threading.Event()
        every = max(self.config.lease_seconds / 3, 0.05)

        def beat():
            while not stop.wait(every):
                try:
                    with self.db.begin() as c:
                        c.execute(
                            artifacts.update()
                            .where(artifacts.c.id == artifact_id, artifacts.c.status == status)
                            .values(lease_until=self.clock() + self.config.lease_seconds)
                        )
                except Exception as exc:
                    if is_database_outage(exc):
                        self.note_outage()
                    log.warning("lease renewal of %s failed", artifact_id)

        thread = threading.Thread(target=beat, name="kvcdn-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    # -- upload ------------------------------------------------------------------------------

    def begin_upload(
        self, tenant: str, name: str, size: int, sha256: str, visibility: str, hints: dict[str, Any]
    ) -> dict[str, Any]:
        """Reserve quota and create the upload's row (``pending``) in one transaction."""
        if size > self.config.max_artifact_bytes:
            raise ApiError(
                413,
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"size_bytes is over this server's maximum of {self.config.max_artifact_bytes}",
            )
        if size > self.config.quota_bytes:
            raise ApiError(
                403, ErrorCode.QUOTA_EXCEEDED, f"storage quota of {self.config.quota_bytes} bytes would be exceeded"
            )
        self.quota.ensure_row(tenant)
        now = self.clock()
        url_expires = int(now) + self.config.upload_ttl
        record = {
            "id": str(uuid.uuid4()),
            "tenant": tenant,
            "name": name,
            "visibility": visibility,
            "status": "pending",
            "size_bytes": size,
            "sha256": sha256.lower(),
            "declared": json.dumps(hints, sort_keys=True),
            "created_at": now,
            "expires_at": url_expires + self.config.pending_grace,
            "updated_at": now,
        }
        with self.db.begin() as c:
            if not self.quota.reserve(c, tenant, size):
                raise self.quota.refusal(c, tenant)
            c.execute(artifacts.insert().values(**record))
        return {**record, "url_expires": url_expires}

    def begin_chunked(
        self, tenant: str, name: str, sha256: str, visibility: str, hints: dict[str, Any], record
    ) -> tuple[dict[str, Any], dict[str, int], set[str]]:
        """Create a chunked upload's row (``pending``), its references and its reservation (the
        bytes of the objects the tenant does not hold yet) in one transaction; returns the row,
        the record's objects and those present for this tenant."""
        objects = chunks.objects_of(record)
        if record.size > self.config.max_artifact_bytes:
            raise ApiError(
                413,
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"size_bytes is over this server's maximum of {self.config.max_artifact_bytes}",
            )
        self.quota.ensure_row(tenant)
        now = self.clock()
        url_expires = int(now) + self.config.upload_ttl
        row = {
            "id": str(uuid.uuid4()),
            "tenant": tenant,
            "name": name,
            "visibility": visibility,
            "status": "pending",
            "size_bytes": record.size,
            "sha256": sha256.lower(),
            "declared": json.dumps(hints, sort_keys=True),
            "created_at": now,
            "expires_at": url_expires + self.config.pending_grace,
            "updated_at": now,
            "record": record.to_json().decode("utf-8"),
            "charge": 0,
        }
        with self.db.begin() as c:
            # the usage row first (a confirm and a delete take it first too): one lock order
            self.quota.lock(c, tenant)
            c.execute(artifacts.insert().values(**row))
            present, charge = chunks.begin(c, tenant, row["id"], objects, now)
            if charge > self.config.quota_bytes or not self.quota.reserve(c, tenant, charge):
                raise self.quota.refusal(c, tenant)
            c.execute(artifacts.update().where(artifacts.c.id == row["id"]).values(charge=charge))
        return {**row, "charge": charge, "url_expires": url_expires}, objects, present

    def set_multipart(self, artifact_id: str, multipart_id: str) -> None:
        with self.db.begin() as c:
            c.execute(artifacts.update().where(artifacts.c.id == artifact_id).values(multipart_id=multipart_id))

    def abandon(self, artifact_id: str, reason: str) -> None:
        """An upload the server could not set up (no URL was handed out): give everything back."""
        self.end(artifact_id, LIVE[:-1], "failed", reason)

    def _refuse_state(self, row, doing: str) -> ApiError:
        if row is None or row.status not in LIVE + ("failed", "expired"):
            return not_found()
        return {
            "ready": ApiError(409, ErrorCode.ALREADY_CONFIRMED, "this artifact is already confirmed"),
            "uploading": ApiError(409, ErrorCode.UPLOAD_IN_PROGRESS, "another PUT of this upload is in progress"),
            "confirming": ApiError(409, ErrorCode.CONFIRM_IN_PROGRESS, "this upload is being confirmed"),
            "failed": ApiError(
                409, ErrorCode.UPLOAD_FAILED, f"this upload failed{': ' + row.error if row.error else ''}; start again"
            ),
            "expired": ApiError(
                410, ErrorCode.UPLOAD_EXPIRED, "the upload expired before it was confirmed; start again"
            ),
        }.get(row.status, ApiError(409, ErrorCode.CONFLICT, f"cannot {doing} an upload that is {row.status}"))

    def _expire_if_due(self, row) -> None:
        if row is not None and row.status in OPEN and row.expires_at < self.clock():
            self.end(row.id, OPEN, "expired")
            raise ApiError(410, ErrorCode.UPLOAD_EXPIRED, "the upload expired before it was confirmed; start again")

    @contextlib.contextmanager
    def receiving(self, artifact_id: str):
        """Hold the one PUT an upload may have at a time; yields the temp file path to write.

        On a clean exit the temp file becomes the upload's bytes (``uploaded``); otherwise the
        upload goes back to ``pending``. A second PUT meanwhile gets 409. The previous bytes of the
        upload are removed first, so that the disk holds at most one copy (the quota reserved).
        """
        self._expire_if_due(self.row(artifact_id))
        now = self.clock()
        free: list[sa.ColumnElement[bool]] = [artifacts.c.status.in_(OPEN)]
        if self.judging_leases(now):  # a PUT whose server stopped may be taken over
            free.append(sa.and_(artifacts.c.status == "uploading", artifacts.c.lease_until < now))
        with self.db.begin() as c:
            took = c.execute(
                artifacts.update()
                .where(artifacts.c.id == artifact_id, sa.or_(*free))
                .values(status="uploading", lease_until=now + self.config.lease_seconds, updated_at=now)
            ).rowcount
        if not took:
            raise self._refuse_state(self.row(artifact_id), "upload to")
        # new bytes replace any earlier ones, also those an interrupted confirm had moved already
        self.storage.delete(upload_key(artifact_id))
        self.storage.delete(artifact_key(artifact_id))
        directory = self.temp_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with self._using_lock:  # created and marked at once: the collector never sees it unmarked
            fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{artifact_id}-", dir=directory)
            self._using.add(Path(tmp))
        os.close(fd)
        ok = False
        try:
            with self.lease(artifact_id, "uploading"):
                yield Path(tmp)
                if self.local:
                    os.replace(tmp, self.storage.path_of(upload_key(artifact_id)))
                else:
                    self.storage.put_file(upload_key(artifact_id), Path(tmp))
            with self.db.begin() as c:
                ok = self._move(c, artifact_id, ("uploading",), "uploaded", lease_until=None)
            if not ok:  # expired or deleted meanwhile: the collector owns it now
                raise self._refuse_state(self.row(artifact_id), "upload to")
        finally:
            Path(tmp).unlink(missing_ok=True)
            self._done_using(Path(tmp))
            if not ok:
                with self.db.begin() as c:
                    self._move(c, artifact_id, ("uploading",), "pending", lease_until=None)

    def temp_dir(self) -> Path:
        """Where PUTs stream to: next to the objects on local storage (one rename), else the data dir."""
        if self.local:
            path = self.storage.path_of(upload_key("x")).parent
            path.mkdir(parents=True, exist_ok=True)
            return path
        return self.tmp_dir

    def confirm(
        self,
        tenant: str,
        artifact_id: str,
        parts: list[dict[str, Any]] | None,
        digest: str | None = None,
        size: int | None = None,
        replace: bool = False,
    ) -> dict[str, Any]:
        """Check the uploaded bytes and make the artifact ``ready``.

        A refusal (the bytes are wrong) fails the upload, its reservation going back, with a
        one-line 422. Any other failure (the database or the object store went away, even in the
        last transaction) hands the upload back to ``uploaded`` with its bytes, so that a retried
        confirm checks them again and succeeds; when not even that can be written, the lease runs
        out and the collector (or the retry) hands it back.

        ``replace``: the tenant's other ready artifacts of the same name are deleted in the same
        transaction, so that a name never shows two objects and, of racing replacements, the last
        one confirmed stays (the tenant's usage row is locked first: confirms of one tenant that
        replace queue there)."""
        check_id(artifact_id)
        row = self.row(artifact_id)
        if row is None or row.tenant != tenant:
            raise not_found()
        self._expire_if_due(row)
        if row.status == "confirming" and self._lease_ran_out(row):
            self.reclaim(artifact_id, "confirming", self.clock())  # its server stopped: take it back
        with self.db.begin() as c:
            moved = self._move(c, artifact_id, OPEN, "confirming", lease_until=self.clock() + self.config.lease_seconds)
        if not moved:
            raise self._refuse_state(self.row(artifact_id), "confirm")
        with self.lease(artifact_id, "confirming"):
            try:
                if row.record is not None:
                    summary, entry = self._check_chunked(row, digest, size)
                else:
                    summary, entry = check_upload(self.storage, row, parts, digest, size, self.local_copy)
            except Exception as exc:
                raise self._check_failed(artifact_id, exc) from None
            try:
                confirmed, replaced = self._make_ready(row, summary, entry, replace)
            except Exception:
                with contextlib.suppress(Exception):  # the database may still be away: the lease covers it
                    self._hand_back(artifact_id)
                raise
        for old in replaced:
            self._remove_objects(old.id, old.multipart_id)
        if confirmed is None:
            raise self._lost_meanwhile(artifact_id)
        return view(confirmed)

    def _check_chunked(self, row, digest: str | None, size: int | None) -> tuple[dict[str, Any], prefix.Entry]:
        """A chunked upload's confirm checks: every object stored, then the `.kv` file rebuilt from
        them (each object checked against its digest) checked as a whole-file confirm checks it."""
        self.objects.check_present(row)
        if size is not None and size != row.size_bytes:
            raise Refused(422, ErrorCode.SIZE_MISMATCH, f"confirmed size_bytes {size}, declared {row.size_bytes}")
        try:
            with self.objects.rebuilt(row) as path:
                return check_file(path, row, digest)
        except KvcdnError as exc:  # an object read back does not hash to its digest
            raise Refused(422, ErrorCode.DIGEST_MISMATCH, str(exc).splitlines()[0][:300]) from None

    def index_unindexed(self) -> int:
        """Index the ready artifacts the prefix index lacks (confirmed before the server kept one):
        each one's header and token ids read from its object (checked at its confirm), then indexed
        in a transaction that finds it still ready and still unindexed (a delete, or another replica
        doing the same, may come first). One pass over the artifacts table; returns how many it
        indexed. An artifact that cannot be read is left out with one warning line."""
        from kvcdn_core import artifact

        a, pa = artifacts.c, prefix.prefix_artifacts.c
        unindexed = sa.and_(a.status == "ready", ~sa.exists().where(pa.artifact_id == a.id))
        done, after = 0, ""
        while True:
            with self.reads.connect() as c:
                rows = c.execute(sa.select(artifacts).where(unindexed, a.id > after).order_by(a.id).limit(100)).all()
            if not rows:
                return done
            after = rows[-1].id
            for row in rows:
                try:
                    with self.artifact_copy(row) as path:
                        header = artifact.read_header(path)
                        entry = prefix.entry_of(header, artifact.read_token_ids(path, header))
                except Exception as exc:  # noqa: BLE001 (its object is damaged or gone: the others still go in)
                    log.warning(
                        "artifact %s left out of the prefix index: %s",
                        row.id,
                        (str(exc).splitlines() or [repr(exc)])[0],
                    )
                    continue
                with self.db.begin() as c:
                    ready = sa.select(a.id).where(a.id == row.id, a.status == "ready").with_for_update()
                    if c.execute(ready).first() is None:
                        continue
                    if c.execute(sa.select(pa.artifact_id).where(pa.artifact_id == row.id)).first() is not None:
                        continue
                    prefix.index_artifact(c, row.id, prefix.scope_of(row.tenant, row.visibility), row.name, entry)
                    done += 1

    def artifact_copy(self, row):
        """A local path of a ready artifact's `.kv` file: its object, or rebuilt from its chunks."""
        if row.record is not None:
            return self.objects.rebuilt(row)
        return self.local_copy(artifact_key(row.id))

    def _make_ready(self, row, summary: dict, entry: prefix.Entry, replace: bool):
        """The last transaction of a confirm: the artifact row (None when the upload was deleted or
        taken back meanwhile) and the rows of the same name it replaced. The artifact enters the
        prefix index in this transaction, and what it replaces leaves it."""
        tenant, artifact_id, name = row.tenant, row.id, row.name
        replaced = []
        with self.db.begin() as c:
            chunked = c.execute(sa.select(artifacts).where(artifacts.c.id == artifact_id)).first()
            chunked = chunked if chunked is not None and chunked.record is not None else None
            if replace or chunked is not None:
                self.quota.lock(c, tenant)
            done = self._move(
                c,
                artifact_id,
                ("confirming",),
                "ready",
                lease_until=None,
                confirmed_at=self.clock(),
                manifest=json.dumps(summary, sort_keys=True),
                error=None,
            )
            if done and chunked is not None:
                chunks.make_ready(c, tenant, chunked)
            if done:
                prefix.index_artifact(c, artifact_id, prefix.scope_of(tenant, row.visibility), name, entry)
            if done and replace:
                replaced = self._drop_others_named(c, tenant, name, artifact_id)
            # read in the same transaction: a delete or a later replace may remove it right after
            confirmed = c.execute(sa.select(artifacts).where(artifacts.c.id == artifact_id)).first() if done else None
        return confirmed, replaced

    def _check_failed(self, artifact_id: str, exc: Exception) -> BaseException:
        """What a confirm whose check did not pass answers, the upload moved accordingly."""
        if self.row(artifact_id) is None:
            self._remove_objects(artifact_id)  # what the check had moved meanwhile goes too
            return self._deleted()
        if isinstance(exc, Refused):
            self.end(artifact_id, ("confirming",), "failed", exc.error.message)
            return exc.error
        if isinstance(exc, NotYet):
            with self.db.begin() as c:
                self._move(c, artifact_id, ("confirming",), "pending", lease_until=None)
            return exc.error
        self._hand_back(artifact_id)  # the store or the database failed, not the bytes
        return exc

    def _hand_back(self, artifact_id: str) -> None:
        """``confirming`` → ``uploaded``: the bytes stay (under either key) for the next confirm."""
        with self.db.begin() as c:
            self._move(c, artifact_id, ("confirming",), "uploaded", lease_until=None, expires_at=self._extended())

    def _extended(self):
        """An upload handed back has at least ``pending_grace`` seconds left to be confirmed again."""
        floor = self.clock() + self.config.pending_grace
        return sa.case((artifacts.c.expires_at < floor, floor), else_=artifacts.c.expires_at)

    @staticmethod
    def _deleted() -> ApiError:
        return ApiError(409, ErrorCode.UPLOAD_FAILED, "the upload was deleted while it was being confirmed")

    def _lost_meanwhile(self, artifact_id: str) -> ApiError:
        """A confirm whose checks passed but whose row had moved on by its last transaction."""
        row = self.row(artifact_id)
        if row is None:
            return self._deleted()
        if row.status in OPEN:  # handed back while the database was away: the next confirm will do
            return database_unavailable("the confirm was interrupted while the database was away; confirm again")
        return self._refuse_state(row, "confirm")

    def note_outage(self) -> None:
        """This process could not reach the database just now."""
        self.outage_at = self.clock()

    def judging_leases(self, now: float) -> bool:
        """Leases are judged only a lease period after this process last saw the database fail."""
        return now >= self.outage_at + self.config.lease_seconds

    def _lease_ran_out(self, row) -> bool:
        now = self.clock()
        return (row.lease_until or 0) < now and self.judging_leases(now)

    def _drop_others_named(self, c, tenant: str, name: str, keep: str) -> list:
        """Delete the tenant's other ready artifacts called ``name`` and give their quota back; the
        caller removes their objects once the transaction is committed."""
        rows = c.execute(
            sa.select(
                artifacts.c.id, artifacts.c.tenant, artifacts.c.size_bytes, artifacts.c.multipart_id, artifacts.c.charge
            ).where(
                artifacts.c.tenant == tenant,
                artifacts.c.name == name,
                artifacts.c.status == "ready",
                artifacts.c.id != keep,
            )
        ).all()
        for old in rows:
            c.execute(artifacts.delete().where(artifacts.c.id == old.id))
            self._release(c, old, old.id, was_ready=True)
        return rows

    @contextlib.contextmanager
    def local_copy(self, key: str):
        """A local path of the object (the file itself on local storage; else a copy in
        ``tmp/.copy-<id>-<random>/``, removed on exit, or by the collector after a crash)."""
        if self.local:
            yield self.storage.path_of(key)
            return
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        with self._using_lock:
            tmp = Path(tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{key.rpartition('/')[2]}-", dir=self.tmp_dir))
            self._using.add(tmp)
        try:
            target = tmp / "object.kv"
            self.storage.get_file(key, target)
            yield target
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            self._done_using(tmp)

    def in_use(self, path: Path) -> bool:
        """Whether work of this process uses the temp file ``path`` (the collector leaves it alone)."""
        with self._using_lock:
            return path in self._using

    def _done_using(self, path: Path) -> None:
        with self._using_lock:
            self._using.discard(path)

    # -- deletion ----------------------------------------------------------------------------

    def delete(self, tenant: str, artifact_id: str) -> None:
        check_id(artifact_id)
        with self.db.begin() as c:
            # the tenant's usage row first, as a replacing confirm takes it: one lock order, no deadlock
            self.quota.lock(c, tenant)
            row = c.execute(
                sa.select(artifacts).where(artifacts.c.id == artifact_id, artifacts.c.tenant == tenant)
            ).first()
            if row is None or row.status not in LIVE:
                raise not_found()
            if (
                c.execute(
                    artifacts.delete().where(artifacts.c.id == artifact_id, artifacts.c.status == row.status)
                ).rowcount
                != 1
            ):
                raise ApiError(409, ErrorCode.CONFLICT, "the artifact changed meanwhile; try again")
            # the single place a deleted artifact leaves the server's state (its prefix index too)
            self._release(c, row, artifact_id, was_ready=row.status == "ready")
        self._remove_objects(artifact_id, row.multipart_id)

    def reclaim(self, artifact_id: str, status: str, now: float) -> str | None:
        """Hand back a PUT or confirm whose lease ran out (checked again in the UPDATE); the count it
        goes to (``handed_back`` or ``failed``), or None when it had moved on."""
        with self.db.begin() as c:
            row = c.execute(
                sa.select(
                    artifacts.c.tenant,
                    artifacts.c.size_bytes,
                    artifacts.c.multipart_id,
                    artifacts.c.error,
                    artifacts.c.charge,
                ).where(artifacts.c.id == artifact_id)
            ).first()
            if row is None:
                return None
            ran_out = artifacts.update().where(
                artifacts.c.id == artifact_id, artifacts.c.status == status, artifacts.c.lease_until < now
            )
            if status == "confirming" and row.error == INTERRUPTED:
                error = "its confirm was interrupted twice (the server checking it stopped)"
                if not c.execute(
                    ran_out.values(status="failed", lease_until=None, updated_at=now, error=error)
                ).rowcount:
                    return None
                self._release(c, row, artifact_id, was_ready=False)
            else:
                back, error = ("uploaded", INTERRUPTED) if status == "confirming" else ("pending", row.error)
                values = {"status": back, "lease_until": None, "updated_at": now, "error": error}
                moved = c.execute(ran_out.values(**values, expires_at=self._extended())).rowcount
                return "handed_back" if moved else None
        self._remove_objects(artifact_id, row.multipart_id)
        return "failed"
