"""Artifacts of tenants in one storage backend, with no database.

Object layout (every key built from server-side values only: a hash of the verified customer id and
a uuid4 the server drew; the client's ``name`` is never part of a key)::

    t/<tenant>/<id>.upload        bytes as uploaded, before confirm (never served)
    t/<tenant>/<id>.confirming    the upload, moved here by confirm before it is checked (no URL
                                  names this key, so nobody can change the bytes being checked)
    t/<tenant>/<id>.pending.json  the declared upload, until confirm or expiry
    t/<tenant>/<id>.kv            the confirmed artifact
    t/<tenant>/<id>.meta.json     its metadata, read from the artifact itself at confirm
    public/<id>.json              {"tenant": ...}: how anyone finds a public artifact by id
    orgs/<slug>.json              API-key generations (see apikeys.py)

Uploads land on a separate key. Confirm first moves them to a key no URL can write, checks them
there and moves them to ``.kv`` only after every check passed, so a still-valid upload URL can never
change the bytes being checked nor a confirmed artifact. Replicas share nothing but the bucket.

Quota: in one process a per-tenant lock makes "check usage, write the pending record" atomic.
Across replicas each upload-url writes its pending record first and then counts again, refusing
(and removing its record) when the count is over the quota: two replicas racing for the last slot
may both refuse, but they can never both admit.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvcdn_core import artifact as kvformat
from kvcdn_core import ArtifactError, KvcdnError
from kvcdn_core import LocalStorage

from kvcdn_server.errors import ApiError, not_found

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
TENANT = re.compile(r"^[0-9a-f]{32}$")
PUBLIC_FIELDS = ("artifact_id", "name", "visibility", "status", "size_bytes", "sha256", "created_at",
                 "confirmed_at", "customer_id", "manifest")
HINTS = ("model_id", "architecture", "tokens", "layers", "dtype", "quantization")
#: public views leave out who owns an artifact; its owner sees it through their own routes
OWNER_FIELDS = ("customer_id",)
#: striped locks serialise the quota check of one tenant in this process (bounded memory)
LOCK_STRIPES = 64


def now_iso(ts: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(ts if ts is not None else time.time(), dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def tenant_of(customer_id: str) -> str:
    return hashlib.sha256(customer_id.encode()).hexdigest()[:32]


def check_id(artifact_id: str) -> str:
    """Only canonical uuid4 ids reach storage; anything else is simply not found."""
    if not isinstance(artifact_id, str) or not UUID.match(artifact_id):
        raise not_found()
    return artifact_id


def check_name(name: str) -> str:
    problem = None
    if not 1 <= len(name) <= 255:
        problem = "must be 1 to 255 characters"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "must not contain control characters"
    elif "/" in name or "\\" in name:
        problem = "must not contain '/' or '\\'"
    elif ".." in name or name in (".",):
        problem = "must not contain '..'"
    elif name.endswith(".meta.json"):
        problem = "must not end in '.meta.json'"
    elif name != name.strip():
        problem = "must not start or end with white space"
    if problem:
        raise ApiError(422, "invalid_name", f"artifact name {problem}")
    return name


def manifest_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """What listings show, read from the artifact's own manifest."""
    return {
        **kvformat.summary(manifest),
        "format_version": kvformat.FORMAT_VERSION,
        "kvcdn_version": manifest.get("kvcdn_version"),
    }


def public_view(record: dict[str, Any], owner: bool = True) -> dict[str, Any]:
    """The fields callers see; ``owner=False`` (someone else's public artifact) hides the owner."""
    return {key: record.get(key) for key in PUBLIC_FIELDS if owner or key not in OWNER_FIELDS}


class ArtifactStore:
    def __init__(self, storage, config):
        self.storage = storage
        self.config = config
        self.local = isinstance(storage, LocalStorage)
        self.tmp_dir = Path(config.home) / "tmp"
        self._locks = [threading.Lock() for _ in range(LOCK_STRIPES)]

    def tenant_lock(self, tenant: str) -> threading.Lock:
        return self._locks[int(tenant[:8], 16) % LOCK_STRIPES]

    # -- keys ------------------------------------------------------------------------------

    @staticmethod
    def key(tenant: str, artifact_id: str, suffix: str) -> str:
        assert TENANT.match(tenant) and UUID.match(artifact_id)
        return f"t/{tenant}/{artifact_id}{suffix}"

    def blob_object(self, tenant: str, artifact_id: str) -> str:
        """The object a signed blob URL names (``t/<tenant>/<id>``)."""
        return f"t/{tenant}/{artifact_id}"

    def _read_json(self, key: str) -> dict[str, Any] | None:
        raw = self.storage.read_bytes(key)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _write_json(self, key: str, value: dict[str, Any]) -> None:
        self.storage.write_bytes(key, json.dumps(value, sort_keys=True).encode())

    # -- lookups ---------------------------------------------------------------------------

    def ready(self, tenant: str, artifact_id: str) -> dict[str, Any] | None:
        return self._read_json(self.key(tenant, artifact_id, ".meta.json"))

    def pending(self, tenant: str, artifact_id: str) -> dict[str, Any] | None:
        return self._read_json(self.key(tenant, artifact_id, ".pending.json"))

    def public_tenant(self, artifact_id: str) -> str | None:
        entry = self._read_json(f"public/{artifact_id}.json")
        tenant = (entry or {}).get("tenant")
        return tenant if isinstance(tenant, str) and TENANT.match(tenant) else None

    def readable(self, tenant: str | None, artifact_id: str) -> tuple[str, dict[str, Any]]:
        """The caller's own artifact (ready or pending) or any public one; else 404."""
        check_id(artifact_id)
        if tenant is not None:
            record = self.ready(tenant, artifact_id) or self.pending(tenant, artifact_id)
            if record is not None:
                return tenant, record
        owner = self.public_tenant(artifact_id)
        if owner is not None:
            record = self.ready(owner, artifact_id)
            if record is not None and record.get("visibility") == "public":
                return owner, record
        raise not_found()

    # -- usage, quota and cleanup ----------------------------------------------------------

    def _tenant_objects(self, tenant: str) -> dict[str, dict[str, int]]:
        """``id → {suffix: size}`` of a tenant's objects."""
        found: dict[str, dict[str, int]] = {}
        for info in self.storage.list(f"t/{tenant}/"):
            name = info.key.rpartition("/")[2]
            artifact_id, dot, suffix = name.partition(".")
            if UUID.match(artifact_id) and dot:
                found.setdefault(artifact_id, {})["." + suffix] = info.size
        return found

    def _drop(self, tenant: str, artifact_id: str, record: dict[str, Any] | None = None) -> None:
        """Remove an unconfirmed upload: its bytes, any multipart upload and its pending record."""
        multipart = (record or {}).get("multipart")
        if multipart and hasattr(self.storage, "abort_multipart"):
            try:
                self.storage.abort_multipart(self.key(tenant, artifact_id, ".upload"), multipart["upload_id"])
            except Exception:
                pass
        self.storage.delete(self.key(tenant, artifact_id, ".upload"))
        self.storage.delete(self.key(tenant, artifact_id, ".confirming"))
        self.storage.delete(self.key(tenant, artifact_id, ".pending.json"))

    def usage(self, tenant: str, sweep: bool = True) -> dict[str, int]:
        usage = {"artifacts": 0, "storage_bytes": 0, "pending_artifacts": 0, "pending_bytes": 0}
        now = time.time()
        for artifact_id, objects in self._tenant_objects(tenant).items():
            if ".meta.json" in objects:
                usage["artifacts"] += 1
                usage["storage_bytes"] += objects.get(".kv", 0)
                if sweep:  # bytes PUT with a still-valid URL after confirm: nobody will read them
                    for suffix in (".upload", ".confirming"):
                        if suffix in objects:
                            self.storage.delete(self.key(tenant, artifact_id, suffix))
            elif ".pending.json" in objects:
                record = self.pending(tenant, artifact_id) or {}
                if sweep and record.get("expires", 0) < now:
                    self._drop(tenant, artifact_id, record)
                    continue
                usage["pending_artifacts"] += 1
                usage["pending_bytes"] += int(record.get("size_bytes", 0))
            elif sweep:  # bytes nobody declared, or a confirm that stopped half-way
                for suffix in (".upload", ".confirming", ".kv"):
                    if suffix in objects:
                        self.storage.delete(self.key(tenant, artifact_id, suffix))
        return usage

    def limits(self) -> dict[str, int]:
        return {"artifacts": self.config.quota_artifacts, "storage_bytes": self.config.quota_bytes,
                "max_artifact_bytes": self.config.max_artifact_bytes}

    def check_quota(self, usage: dict[str, int], artifacts: int, size: int) -> None:
        if usage["artifacts"] + artifacts > self.config.quota_artifacts:
            raise ApiError(403, "quota_exceeded",
                           f"artifact quota of {self.config.quota_artifacts} reached")
        if usage["storage_bytes"] + size > self.config.quota_bytes:
            raise ApiError(403, "quota_exceeded",
                           f"storage quota of {self.config.quota_bytes} bytes would be exceeded")

    def sweep_all(self) -> int:
        """Remove expired pending uploads of every tenant; return how many went."""
        before = 0
        tenants = {info.key.split("/")[1] for info in self.storage.list("t/") if info.key.count("/") == 2}
        for tenant in tenants:
            if TENANT.match(tenant):
                objects = self._tenant_objects(tenant)
                before += sum(1 for o in objects.values() if ".pending.json" in o)
                self.usage(tenant, sweep=True)
                before -= sum(1 for o in self._tenant_objects(tenant).values() if ".pending.json" in o)
        return before

    # -- upload ----------------------------------------------------------------------------

    def begin_upload(self, customer_id: str, name: str, size: int, sha256: str, visibility: str,
                     hints: dict[str, Any]) -> dict[str, Any]:
        """Check the quota and write the pending record (the reservation); return the record."""
        tenant = tenant_of(customer_id)
        if size > self.config.max_artifact_bytes:
            raise ApiError(413, "payload_too_large",
                           f"size_bytes is over this server's maximum of {self.config.max_artifact_bytes}")
        now = time.time()
        url_expires = int(now) + self.config.upload_ttl
        record = {
            "artifact_id": str(uuid.uuid4()), "name": name, "visibility": visibility, "status": "pending",
            "size_bytes": size, "sha256": sha256.lower(), "created_at": now_iso(now), "confirmed_at": None,
            "customer_id": customer_id, "manifest": None, "declared": hints,
            "url_expires": url_expires, "expires": url_expires + self.config.pending_grace,
        }
        with self.tenant_lock(tenant):
            # Pending uploads hold their place until they are confirmed or expire.
            self.check_quota(self._reserved(self.usage(tenant)), 1, size)
            self.save_pending(tenant, record)
            # Another replica may have reserved meanwhile: count again, this record included.
            try:
                self.check_quota(self._reserved(self.usage(tenant, sweep=False)), 0, 0)
            except ApiError:
                self._drop(tenant, record["artifact_id"], record)
                raise
        return record

    @staticmethod
    def _reserved(usage: dict[str, int]) -> dict[str, int]:
        return {"artifacts": usage["artifacts"] + usage["pending_artifacts"],
                "storage_bytes": usage["storage_bytes"] + usage["pending_bytes"]}

    def save_pending(self, tenant: str, record: dict[str, Any]) -> None:
        self._write_json(self.key(tenant, record["artifact_id"], ".pending.json"), record)

    def confirm(self, tenant: str, artifact_id: str, parts: list[dict[str, Any]] | None) -> dict[str, Any]:
        check_id(artifact_id)
        record = self.pending(tenant, artifact_id)
        if record is None:
            if self.ready(tenant, artifact_id) is not None:
                raise ApiError(409, "already_confirmed", "this artifact is already confirmed")
            raise not_found()
        if time.time() > record.get("expires", 0):
            self._drop(tenant, artifact_id, record)
            raise ApiError(410, "upload_expired", "the upload expired before it was confirmed; start again")
        upload_key = self.key(tenant, artifact_id, ".upload")
        if record.get("multipart"):
            if not parts:
                raise ApiError(409, "upload_incomplete", "a multipart upload is confirmed with its parts' ETags")
            try:
                self.storage.complete_multipart(upload_key, record["multipart"]["upload_id"], parts)
            except Exception as exc:
                raise ApiError(409, "upload_incomplete", f"the parts could not be assembled: {exc}") from None
            record["multipart"] = None
            self.save_pending(tenant, record)
        checked_key = self.key(tenant, artifact_id, ".confirming")
        if self.storage.size_of(upload_key) is None:
            if self.storage.size_of(checked_key) is not None:
                raise ApiError(409, "already_confirmed", "this upload is being or has been confirmed")
            raise ApiError(409, "upload_incomplete", "no bytes have been uploaded for this artifact yet")
        # Move the bytes out of reach of the upload URL first, then check them where they now are.
        try:
            self.storage.rename(upload_key, checked_key)
        except (OSError, KvcdnError):
            # Another confirm of the same upload (a retry racing the first) got there first.
            raise ApiError(409, "already_confirmed", "this upload is being or has been confirmed") from None
        size = self.storage.size_of(checked_key)
        if size is None:
            raise ApiError(409, "already_confirmed", "this upload is being or has been confirmed")

        def refuse(status: int, code: str, message: str):
            self._drop(tenant, artifact_id, record)
            return ApiError(status, code, message)

        if size != record["size_bytes"]:
            raise refuse(422, "size_mismatch", f"uploaded {size} bytes, declared {record['size_bytes']}")
        with self._local_copy(checked_key) as path:
            digest = _sha256_file(path)
            if digest != record["sha256"]:
                raise refuse(422, "sha256_mismatch", "the uploaded bytes do not match the declared sha256")
            try:
                header = kvformat.read_header(path)
            except ArtifactError as exc:
                reason = str(exc).partition(": ")[2] or "unreadable"
                raise refuse(422, "not_a_kv_artifact", f"the upload is not a readable .kv artifact: {reason}") from None
        summary = manifest_summary(header.manifest)
        for hint, declared in (record.get("declared") or {}).items():
            if hint in HINTS and declared != summary[hint]:
                raise refuse(422, "manifest_mismatch",
                             f"declared {hint} {declared!r}, the artifact's manifest says {summary[hint]!r}")
        try:
            self.check_quota(self.usage(tenant, sweep=False), 1, size)
        except ApiError as exc:
            raise refuse(exc.status, exc.code, exc.message) from None
        self.storage.rename(checked_key, self.key(tenant, artifact_id, ".kv"))
        final = {key: record[key] for key in PUBLIC_FIELDS if key in record}
        final.update(status="ready", confirmed_at=now_iso(), manifest=summary)
        self._write_json(self.key(tenant, artifact_id, ".meta.json"), final)
        if final["visibility"] == "public":
            self._write_json(f"public/{artifact_id}.json", {"tenant": tenant})
        self.storage.delete(self.key(tenant, artifact_id, ".pending.json"))
        return final

    def _local_copy(self, key: str):
        """A context manager giving a local path of the object (the file itself on local storage)."""
        import contextlib

        @contextlib.contextmanager
        def manager():
            if self.local:
                yield self.storage.path_of(key)
                return
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.tmp_dir) as tmp:
                target = Path(tmp) / "upload.kv"
                self.storage.get_file(key, target)
                yield target

        return manager()

    # -- listing and deletion --------------------------------------------------------------

    def list_ready(self, tenant: str, limit: int, cursor: str | None) -> tuple[list[dict], str | None]:
        ids = sorted(i for i, objects in self._tenant_objects(tenant).items() if ".meta.json" in objects)
        if cursor is not None:
            ids = [i for i in ids if i > cursor]
        page = []
        for artifact_id in ids[:limit]:
            record = self.ready(tenant, artifact_id)
            if record is not None:
                page.append(public_view(record))
        more = len(ids) > limit
        return page, (ids[limit - 1] if more else None)

    def delete(self, tenant: str, artifact_id: str) -> None:
        check_id(artifact_id)
        ready = self.ready(tenant, artifact_id)
        pending = self.pending(tenant, artifact_id)
        if ready is None and pending is None:
            raise not_found()
        if ready is not None and ready.get("visibility") == "public":
            self.storage.delete(f"public/{artifact_id}.json")
        self.storage.delete(self.key(tenant, artifact_id, ".kv"))
        self.storage.delete(self.key(tenant, artifact_id, ".meta.json"))
        self._drop(tenant, artifact_id, pending)


def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()
