"""Artifacts of tenants: state in the database (``db.py``), bytes in object storage.

Object keys are chosen by the server from the artifact's random id only (never the client's name
nor anything derived from the owner)::

    uploads/<id>     bytes as uploaded, before confirm (never served)
    artifacts/<id>   the confirmed artifact

State is never inferred from object listings. Every change of an upload's state is one conditional
UPDATE (``... WHERE status IN (...)``), so two requests or two replicas can never both move the
same upload, and quota is reserved at upload-url by one atomic conditional UPDATE of the tenant's
usage row (``... WHERE artifacts + 1 <= quota AND bytes + size <= quota``): replicas on one
database cannot over-grant. Reservations are released when an upload fails, expires or is
deleted. The state machine is documented in docs/hosted-api.md.

Work that takes long (a PUT, a confirm) holds a *lease* on its row, renewed by a heartbeat. Only a
refusal (the bytes are wrong) fails an upload; work that stops for any other reason (the database
or the object store went away, the server died) hands the upload back to where it was, so that a
retry succeeds: at once when the work can still say so, else when its lease runs out (see
:meth:`ArtifactStore.collect`). The collector deletes objects only after the database says they are
dead.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import unicodedata
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kvcdn_core import KvcdnError, StorageBackend, nfc, text_problem
from kvcdn_core import artifact as kvformat
from kvcdn_server.db import artifacts, readers, usage
from kvcdn_server.errors import ApiError, database_unavailable, is_database_outage, not_found

log = logging.getLogger("kvcdn.server.store")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
HINTS = ("model_id", "architecture", "tokens", "layers", "dtype", "quantization")
#: states that hold a quota reservation
LIVE = ("pending", "uploading", "uploaded", "confirming", "ready")
#: states an upload can be PUT or confirmed from
OPEN = ("pending", "uploaded")
#: how long rows of failed/expired uploads stay, so that a client's retry learns what happened
KEEP_DEAD_ROWS = 86400
#: The server's temp files are named for their upload, so the collector can tell whose they are:
#: a PUT in progress streams to ``.put-<id>-<random>`` (next to the objects on local storage, else in
#: the server's tmp dir), and a local copy of an S3 object (checked at confirm, loaded for inference)
#: is the directory ``.copy-<id>-<random>`` in the tmp dir.
TEMP_PREFIX = ".put-"
COPY_PREFIX = ".copy-"
#: the state whose live lease keeps a temp file of each kind
TEMP_OWNER = {TEMP_PREFIX: "uploading", COPY_PREFIX: "confirming"}
#: what creating a secret file at start-up leaves in the server's home if the process dies
#: mid-write (``config._secret_file``)
SECRET_TEMP = re.compile(r"\.(api-key-seed|admin-secret|url-signing-key)\.[0-9a-f]{8}\.tmp")
#: the ``error`` of an upload whose confirm was interrupted once (handed back); a second interruption
#: fails it, so that a file that kills the server checking it cannot do so again and again
INTERRUPTED = "its confirm was interrupted"


def now_iso(ts: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(ts if ts is not None else time.time(), dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def check_id(artifact_id: str) -> str:
    """Only canonical uuid4 ids reach the store; anything else is simply not found."""
    if not isinstance(artifact_id, str) or not UUID.match(artifact_id):
        raise not_found()
    return artifact_id


def check_name(name: str) -> str:
    """The NFC form of an artifact name, or 422.

    Names keep the text rule of every shown string (:mod:`kvcdn_core.text`) and are kept in NFC,
    so the composed and decomposed spellings of a name are one name. ``/`` separates parts
    (``team/doc.kv``, the keys of the client's storage backend), and the path rules hold for the
    name's NFKC form too, which folds look-alikes such as fullwidth dots (``．．/x``) into the
    ASCII a path would be read as."""
    problem = text_problem(name)
    if problem is None:
        name = nfc(name)
        problem = text_problem(name)  # normalising can bring a combining mark to the front
    if problem is None and not 1 <= len(name) <= 255:
        problem = "be 1 to 255 characters"
    if problem is None and name != name.strip():
        problem = "not start or end with white space"
    if problem is None:
        problem = _path_problem(name) or _path_problem(unicodedata.normalize("NFKC", name))
    if problem:
        raise ApiError(422, "invalid_name", f"artifact name must {problem}")
    return name


def _path_problem(name: str) -> str | None:
    if "\\" in name:
        return "not contain '\\' (nor a look-alike of it)"
    parts = name.split("/")
    if any(part in ("", ".") for part in parts):
        return "not start or end with '/' nor have an empty or '.' part between slashes (nor look-alikes)"
    if ".." in name:
        return "not contain '..' (nor a look-alike of it)"
    return None


def check_prefix_filter(prefix: str) -> str:
    """A listing prefix in NFC (names are stored so), or 422 when it breaks the text rule."""
    problem = text_problem(prefix)
    if problem is None and len(prefix) > 255:
        problem = "be at most 255 characters"
    if problem:
        raise ApiError(422, "validation_error", f"prefix: must {problem}")
    return nfc(prefix)


def check_hint(field: str, value: object) -> None:
    """A declared manifest fact that is a string keeps the text rule (it is echoed in refusals)."""
    if isinstance(value, str):
        problem = text_problem(value) or (None if len(value) <= 255 else "be at most 255 characters")
        if problem:
            raise ApiError(422, "validation_error", f"manifest.{field}: must {problem}")


def manifest_summary(header: kvformat.Header) -> dict[str, Any]:
    """What listings show, read from the artifact's own header."""
    return {
        **kvformat.summary(header.manifest),
        "format_version": header.format_version,
        "kvcdn_version": header.manifest.get("kvcdn_version"),
    }


def upload_key(artifact_id: str) -> str:
    return f"uploads/{artifact_id}"


def artifact_key(artifact_id: str) -> str:
    return f"artifacts/{artifact_id}"


def view(row, owner: bool = True) -> dict[str, Any]:
    """The fields callers see; ``owner=False`` (someone else's public artifact) hides the owner.

    Besides its own fields each entry carries the fields the original kvcdn client lists
    (``dtype``, ``num_tokens``, ...), read from the artifact's manifest; never ``id`` or
    ``model_name``, which that client takes as aliases of ``artifact_id`` and ``name`` and refuses
    when both are present.
    """
    manifest = json.loads(row.manifest) if row.manifest else None
    out = {
        "artifact_id": row.id,
        "name": row.name,
        "visibility": row.visibility,
        "status": "pending" if row.status in ("uploading", "uploaded") else row.status,
        "size_bytes": row.size_bytes,
        "sha256": row.sha256,
        "created_at": now_iso(row.created_at),
        "confirmed_at": now_iso(row.confirmed_at) if row.confirmed_at else None,
        # the same instant to the microsecond: orders artifacts confirmed within one second
        "confirmed_at_unix": round(row.confirmed_at, 6) if row.confirmed_at else None,
        "manifest": manifest,
    }
    if owner:
        out["customer_id"] = row.tenant
    m = manifest or {}
    out.update(
        dtype=m.get("dtype"),
        storage_dtype=m.get("dtype"),
        num_tokens=m.get("tokens"),
        num_layers=m.get("layers"),
        quantized=bool(m.get("quantization")),
    )
    return out


class ArtifactStore:
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

    # -- lookups ---------------------------------------------------------------------------

    def row(self, artifact_id: str):
        with self.reads.connect() as c:
            return c.execute(sa.select(artifacts).where(artifacts.c.id == artifact_id)).first()

    def readable(self, tenant: str | None, artifact_id: str):
        """The caller's own artifact (any live state) or anyone's ready public one; else 404."""
        check_id(artifact_id)
        row = self.row(artifact_id)
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

    # -- quota -------------------------------------------------------------------------------

    def limits(self) -> dict[str, int]:
        return {
            "artifacts": self.config.quota_artifacts,
            "storage_bytes": self.config.quota_bytes,
            "max_artifact_bytes": self.config.max_artifact_bytes,
        }

    def usage(self, tenant: str) -> dict[str, int]:
        """Ready artifacts and uploads in flight, counted from the artifacts table."""
        query = (
            sa.select(artifacts.c.status, sa.func.count(), sa.func.coalesce(sa.func.sum(artifacts.c.size_bytes), 0))
            .where(artifacts.c.tenant == tenant, artifacts.c.status.in_(LIVE))
            .group_by(artifacts.c.status)
        )
        out = {"artifacts": 0, "storage_bytes": 0, "pending_artifacts": 0, "pending_bytes": 0}
        with self.reads.connect() as c:
            for status, count, size in c.execute(query):
                prefix = "" if status == "ready" else "pending_"
                out[f"{prefix}artifacts"] += int(count)
                out[f"{prefix}{'storage_bytes' if status == 'ready' else 'bytes'}"] += int(size)
        return out

    def reserved(self, tenant: str) -> tuple[int, int]:
        """The tenant's reservation counter (artifacts, bytes): what upload-url checks the quota against."""
        with self.reads.connect() as c:
            row = c.execute(sa.select(usage.c.artifacts, usage.c.bytes).where(usage.c.tenant == tenant)).first()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def _reserve(self, c, tenant: str, size: int) -> bool:
        grant = (
            usage.update()
            .where(
                usage.c.tenant == tenant,
                usage.c.artifacts + 1 <= self.config.quota_artifacts,
                usage.c.bytes + size <= self.config.quota_bytes,
            )
            .values(artifacts=usage.c.artifacts + 1, bytes=usage.c.bytes + size)
        )
        return c.execute(grant).rowcount == 1

    @staticmethod
    def _release(c, tenant: str, size: int) -> None:
        c.execute(
            usage.update()
            .where(usage.c.tenant == tenant)
            .values(artifacts=usage.c.artifacts - 1, bytes=usage.c.bytes - size)
        )

    def _ensure_usage_row(self, tenant: str) -> None:
        with contextlib.suppress(sa.exc.IntegrityError), self.db.begin() as c:
            if c.execute(sa.select(usage.c.tenant).where(usage.c.tenant == tenant)).first() is None:
                c.execute(usage.insert().values(tenant=tenant, artifacts=0, bytes=0))

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

    def _end(self, artifact_id: str, frm: tuple[str, ...], to: str, error: str | None = None) -> bool:
        """Move an upload to ``failed``/``expired`` and give its reservation back, in one transaction;
        then remove its bytes (only after the database says they are dead)."""
        with self.db.begin() as c:
            row = c.execute(
                sa.select(artifacts.c.tenant, artifacts.c.size_bytes, artifacts.c.multipart_id).where(
                    artifacts.c.id == artifact_id
                )
            ).first()
            if row is None or not self._move(c, artifact_id, frm, to, error=error, lease_until=None):
                return False
            self._release(c, row.tenant, row.size_bytes)
        self._remove_objects(artifact_id, row.multipart_id)
        return True

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
                "payload_too_large",
                f"size_bytes is over this server's maximum of {self.config.max_artifact_bytes}",
            )
        if size > self.config.quota_bytes:
            raise ApiError(403, "quota_exceeded", f"storage quota of {self.config.quota_bytes} bytes would be exceeded")
        self._ensure_usage_row(tenant)
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
            if not self._reserve(c, tenant, size):
                held = c.execute(sa.select(usage.c.artifacts).where(usage.c.tenant == tenant)).scalar_one()
                if held + 1 > self.config.quota_artifacts:
                    raise ApiError(403, "quota_exceeded", f"artifact quota of {self.config.quota_artifacts} reached")
                raise ApiError(
                    403, "quota_exceeded", f"storage quota of {self.config.quota_bytes} bytes would be exceeded"
                )
            c.execute(artifacts.insert().values(**record))
        return {**record, "url_expires": url_expires}

    def set_multipart(self, artifact_id: str, multipart_id: str) -> None:
        with self.db.begin() as c:
            c.execute(artifacts.update().where(artifacts.c.id == artifact_id).values(multipart_id=multipart_id))

    def abandon(self, artifact_id: str, reason: str) -> None:
        """An upload the server could not set up (no URL was handed out): give everything back."""
        self._end(artifact_id, LIVE[:-1], "failed", reason)

    def _refuse_state(self, row, doing: str) -> ApiError:
        if row is None or row.status not in LIVE + ("failed", "expired"):
            return not_found()
        return {
            "ready": ApiError(409, "already_confirmed", "this artifact is already confirmed"),
            "uploading": ApiError(409, "upload_in_progress", "another PUT of this upload is in progress"),
            "confirming": ApiError(409, "confirm_in_progress", "this upload is being confirmed"),
            "failed": ApiError(
                409, "upload_failed", f"this upload failed{': ' + row.error if row.error else ''}; start again"
            ),
            "expired": ApiError(410, "upload_expired", "the upload expired before it was confirmed; start again"),
        }.get(row.status, ApiError(409, "conflict", f"cannot {doing} an upload that is {row.status}"))

    def _expire_if_due(self, row) -> None:
        if row is not None and row.status in OPEN and row.expires_at < self.clock():
            self._end(row.id, OPEN, "expired")
            raise ApiError(410, "upload_expired", "the upload expired before it was confirmed; start again")

    @contextlib.contextmanager
    def receiving(self, artifact_id: str):
        """Hold the one PUT an upload may have at a time; yields the temp file path to write.

        On a clean exit the temp file becomes the upload's bytes (``uploaded``); otherwise the
        upload goes back to ``pending``. A second PUT meanwhile gets 409. The previous bytes of the
        upload are removed first, so that the disk holds at most one copy (the quota reserved).
        """
        self._expire_if_due(self.row(artifact_id))
        now = self.clock()
        free = [artifacts.c.status.in_(OPEN)]
        if self._judging_leases(now):  # a PUT whose server stopped may be taken over
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
            self._reclaim(artifact_id, "confirming", self.clock())  # its server stopped: take it back
        with self.db.begin() as c:
            moved = self._move(c, artifact_id, OPEN, "confirming", lease_until=self.clock() + self.config.lease_seconds)
        if not moved:
            raise self._refuse_state(self.row(artifact_id), "confirm")
        with self.lease(artifact_id, "confirming"):
            try:
                summary = self._check(row, parts, digest, size)
            except Exception as exc:
                raise self._check_failed(artifact_id, exc) from None
            try:
                confirmed, replaced = self._make_ready(tenant, artifact_id, row.name, summary, replace)
            except Exception:
                with contextlib.suppress(Exception):  # the database may still be away: the lease covers it
                    self._hand_back(artifact_id)
                raise
        for old in replaced:
            self._remove_objects(old.id, old.multipart_id)
        if confirmed is None:
            raise self._lost_meanwhile(artifact_id)
        return view(confirmed)

    def _make_ready(self, tenant: str, artifact_id: str, name: str, summary: dict, replace: bool):
        """The last transaction of a confirm: the artifact row (None when the upload was deleted or
        taken back meanwhile) and the rows of the same name it replaced."""
        replaced = []
        with self.db.begin() as c:
            if replace:
                self._lock_usage(c, tenant)
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
        if isinstance(exc, _Refused):
            self._end(artifact_id, ("confirming",), "failed", exc.error.message)
            return exc.error
        if isinstance(exc, _NotYet):
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
        return ApiError(409, "upload_failed", "the upload was deleted while it was being confirmed")

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

    def _judging_leases(self, now: float) -> bool:
        """Leases are judged only a lease period after this process last saw the database fail."""
        return now >= self.outage_at + self.config.lease_seconds

    def _lease_ran_out(self, row) -> bool:
        now = self.clock()
        return (row.lease_until or 0) < now and self._judging_leases(now)

    @staticmethod
    def _lock_usage(c, tenant: str) -> None:
        """Hold the tenant's usage row until the transaction ends: confirms that replace and deletes
        of one tenant queue there (a no-op update takes the row lock on every database)."""
        c.execute(usage.update().where(usage.c.tenant == tenant).values(artifacts=usage.c.artifacts))

    def _drop_others_named(self, c, tenant: str, name: str, keep: str) -> list:
        """Delete the tenant's other ready artifacts called ``name`` and give their quota back; the
        caller removes their objects once the transaction is committed."""
        rows = c.execute(
            sa.select(artifacts.c.id, artifacts.c.size_bytes, artifacts.c.multipart_id).where(
                artifacts.c.tenant == tenant,
                artifacts.c.name == name,
                artifacts.c.status == "ready",
                artifacts.c.id != keep,
            )
        ).all()
        for old in rows:
            c.execute(artifacts.delete().where(artifacts.c.id == old.id))
            self._release(c, tenant, old.size_bytes)
        return rows

    def _take_bytes(self, row, parts) -> None:
        """Move the upload's bytes out of reach of its upload URL (an S3 URL stays valid), to the
        artifact key where they are checked: newly uploaded bytes, else those an interrupted confirm
        had moved already, else the parts of a multipart upload, assembled."""
        if self.storage.size_of(upload_key(row.id)) is None:
            if self.storage.size_of(artifact_key(row.id)) is not None:
                return
            if not row.multipart_id:
                raise _NotYet(ApiError(409, "upload_incomplete", "no bytes have been uploaded for this artifact yet"))
            if not parts:
                raise _NotYet(
                    ApiError(409, "upload_incomplete", "a multipart upload is confirmed with its parts' ETags")
                )
            try:
                self.storage.complete_multipart(upload_key(row.id), row.multipart_id, parts)
            except Exception:
                raise _Refused(422, "upload_incomplete", "the parts could not be assembled") from None
        self.storage.rename(upload_key(row.id), artifact_key(row.id))

    def _check(self, row, parts, digest, size) -> dict[str, Any]:
        self._take_bytes(row, parts)
        stored = self.storage.size_of(artifact_key(row.id))
        if stored != row.size_bytes:
            raise _Refused(422, "size_mismatch", f"uploaded {stored} bytes, declared {row.size_bytes}")
        if size is not None and size != row.size_bytes:
            raise _Refused(422, "size_mismatch", f"confirmed size_bytes {size}, declared {row.size_bytes}")
        with self.local_copy(artifact_key(row.id)) as path:
            computed = _sha256_file(path)
            if computed != row.sha256 or (digest is not None and digest.lower() != computed):
                raise _Refused(422, "sha256_mismatch", "the uploaded bytes do not match the declared sha256")
            try:
                header = kvformat.check_file(path)  # structure, every tensor's sha256, the token ids
            except KvcdnError as exc:
                reason = (str(exc).partition(": ")[2] or str(exc) or "unreadable").splitlines()[0][:300]
                raise _Refused(422, "not_a_kv_artifact", f"the upload is not a valid .kv artifact: {reason}") from None
            except (RecursionError, MemoryError, ValueError, TypeError, KeyError, AttributeError):
                raise _Refused(422, "not_a_kv_artifact", "the upload is not a valid .kv artifact") from None
        try:
            summary = manifest_summary(header)
        except (ValueError, TypeError, KeyError, AttributeError):
            raise _Refused(422, "not_a_kv_artifact", "the upload's manifest is malformed") from None
        for hint, declared in json.loads(row.declared).items():
            if hint in HINTS and declared != summary[hint]:
                raise _Refused(
                    422,
                    "manifest_mismatch",
                    f"declared {hint} {declared!r}, the artifact's manifest says {summary[hint]!r}",
                )
        return summary

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

    def _done_using(self, path: Path) -> None:
        with self._using_lock:
            self._using.discard(path)

    # -- deletion ----------------------------------------------------------------------------

    def delete(self, tenant: str, artifact_id: str) -> None:
        check_id(artifact_id)
        with self.db.begin() as c:
            # the tenant's usage row first, as a replacing confirm takes it: one lock order, no deadlock
            self._lock_usage(c, tenant)
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
                raise ApiError(409, "conflict", "the artifact changed meanwhile; try again")
            self._release(c, tenant, row.size_bytes)
        self._remove_objects(artifact_id, row.multipart_id)

    # -- garbage collection ------------------------------------------------------------------

    def collect(self, now: float | None = None) -> dict[str, int]:
        """Reclaim what the database says is dead; return counts of what went.

        - open uploads whose session expired → ``expired`` (reservation released, bytes removed);
        - PUTs and confirms whose lease ran out (their server died, or could not reach the database)
          are handed back: a PUT's upload to ``pending``, a confirm's to ``uploaded`` with its bytes
          (once: a confirm interrupted a second time → ``failed``, reservation released, bytes
          removed). Not for a lease period after this process last failed to reach the database,
          so that live holders renew their leases first;
        - objects under ``uploads/`` and ``artifacts/`` whose row is gone or dead, temp files (of
          PUTs, and copies of S3 objects) no live work holds, and S3 multipart uploads no open
          upload owns, older than the orphan grace period;
        - rows of failed/expired uploads after a day (until then a retry learns what happened).

        ``now``: the clock (tests pass one instead of waiting).
        """
        now = self.clock() if now is None else now
        counts = {
            "expired": 0,
            "handed_back": 0,
            "failed": 0,
            "objects": 0,
            "temp_files": 0,
            "multipart": 0,
            "rows": 0,
        }
        due_when = [sa.and_(artifacts.c.status.in_(OPEN), artifacts.c.expires_at < now)]
        if self._judging_leases(now):
            due_when.append(sa.and_(artifacts.c.status.in_(("uploading", "confirming")), artifacts.c.lease_until < now))
        with self.reads.connect() as c:
            due = c.execute(sa.select(artifacts.c.id, artifacts.c.status).where(sa.or_(*due_when))).all()
        for artifact_id, status in due:
            if status in OPEN:
                counts["expired"] += self._end(artifact_id, OPEN, "expired")
            else:
                outcome = self._reclaim(artifact_id, status, now)
                if outcome:
                    counts[outcome] += 1
        grace = self.config.orphan_grace
        for prefix in ("uploads/", "artifacts/"):
            keys = [info.key for info in self.storage.list(prefix)]
            ids = [k[len(prefix) :] for k in keys]
            alive = self._alive(
                ids,
                # an upload handed back by an interrupted confirm keeps its bytes under artifacts/
                ("pending", "uploading", "uploaded", "confirming") if prefix == "uploads/" else LIVE,
            )
            for key, artifact_id in zip(keys, ids):
                if artifact_id not in alive and self._dead_long_enough(artifact_id, now - grace):
                    self.storage.delete(key)
                    counts["objects"] += 1
        counts["temp_files"] = self._sweep_temp(now - grace, now)
        counts["multipart"] = self._abort_orphan_multiparts(now - grace)
        with self.db.begin() as c:
            counts["rows"] = c.execute(
                artifacts.delete().where(
                    artifacts.c.status.in_(("failed", "expired")), artifacts.c.updated_at < now - KEEP_DEAD_ROWS
                )
            ).rowcount
        return counts

    def _reclaim(self, artifact_id: str, status: str, now: float) -> str | None:
        """Hand back a PUT or confirm whose lease ran out (checked again in the UPDATE); the count it
        goes to (``handed_back`` or ``failed``), or None when it had moved on."""
        with self.db.begin() as c:
            row = c.execute(
                sa.select(
                    artifacts.c.tenant, artifacts.c.size_bytes, artifacts.c.multipart_id, artifacts.c.error
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
                self._release(c, row.tenant, row.size_bytes)
            else:
                back, error = ("uploaded", INTERRUPTED) if status == "confirming" else ("pending", row.error)
                values = {"status": back, "lease_until": None, "updated_at": now, "error": error}
                moved = c.execute(ran_out.values(**values, expires_at=self._extended())).rowcount
                return "handed_back" if moved else None
        self._remove_objects(artifact_id, row.multipart_id)
        return "failed"

    def _alive(self, ids: list[str], states: tuple[str, ...]) -> set[str]:
        alive: set[str] = set()
        with self.reads.connect() as c:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                alive.update(
                    c.execute(
                        sa.select(artifacts.c.id).where(artifacts.c.id.in_(chunk), artifacts.c.status.in_(states))
                    ).scalars()
                )
        return alive

    def _dead_long_enough(self, artifact_id: str, before: float) -> bool:
        row = self.row(artifact_id)
        return row is None or row.updated_at < before

    def _abort_orphan_multiparts(self, before: float) -> int:
        """Multipart uploads (S3) that no open upload row names: a crash between starting one and
        recording it, or an upload that ended while its abort failed."""
        if not type(self.storage).offers("multipart"):
            return 0
        aborted = 0
        for key, multipart_id in self.storage.list_multipart("uploads/"):
            row = self.row(key[len("uploads/") :])
            owned = (
                row is not None
                and row.status in OPEN + ("uploading", "confirming")
                and row.multipart_id == multipart_id
            )
            if not owned and (row is None or row.updated_at < before):
                self.storage.abort_multipart(key, multipart_id)
                aborted += 1
        return aborted

    def _sweep_temp(self, before: float, now: float) -> int:
        """Remove temp files left by work that stopped (a crash mid-PUT or mid-confirm).

        Where they are: ``.put-*`` next to the objects (local storage), everything in the server's
        tmp dir (``.put-*``, ``.copy-*``, and what an older version left there), and a secret's
        temp file in the server's home (a crash while it was created). One is
        removed when nothing in it changed since ``before`` (the orphan grace), no work of this
        process uses it, and its upload holds no live lease for the work that made it (a PUT, a
        confirm: another replica may be doing it).
        """
        places = {self.tmp_dir: True, Path(self.config.home): False}
        places.setdefault(self.temp_dir(), False)
        removed = 0
        for directory, everything in places.items():
            try:
                entries = list(directory.iterdir())
            except FileNotFoundError:
                continue
            for path in entries:
                prefix = next((p for p in TEMP_OWNER if path.name.startswith(p)), None)
                if prefix is None and not everything and not SECRET_TEMP.fullmatch(path.name):
                    continue
                with self._using_lock:
                    if path in self._using:
                        continue
                if prefix is not None:
                    row = self.row(path.name[len(prefix) : len(prefix) + 36])
                    if row is not None and row.status == TEMP_OWNER[prefix] and (row.lease_until or 0) >= now:
                        continue
                changed = _last_change(path)
                if changed is None or changed >= before:
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed += 1
        return removed


class _Refused(Exception):
    """The upload is wrong: it fails (422)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.error = ApiError(status, code, message)


class _NotYet(Exception):
    """The upload is not complete yet: it goes back to where it was and may be confirmed later."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


def _last_change(path: Path) -> float | None:
    """The newest modification time of ``path`` and, for a directory, of everything in it (a copy
    being downloaded changes inside its directory); None when it is gone."""
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            for root, dirs, files in os.walk(path):
                for name in dirs + files:
                    with contextlib.suppress(FileNotFoundError):
                        newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    except FileNotFoundError:
        return None
    return newest


def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()
