"""Storage backends: where artifacts live. Local disk is built in; S3 and hosted are plugins.

A backend is addressed by a URI (``file:///srv/kv``, ``s3://bucket/prefix``, ...) and stores
opaque objects under string keys. Writes are atomic where the medium allows it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlparse

from kvcdn_core import hookimpl
from kvcdn_core.atomic import atomic_open
from kvcdn_core.errors import KvcdnError


@dataclasses.dataclass
class ObjectInfo:
    key: str
    size: int


class StorageBackend:
    """The interface every storage backend implements."""

    #: URI schemes this backend serves.
    schemes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_uri(cls, uri: str) -> StorageBackend:
        raise NotImplementedError

    def put_file(self, key: str, source: Path) -> None:
        """Store the file at ``source`` under ``key``, replacing any previous object."""
        raise NotImplementedError

    def get_file(self, key: str, target: Path) -> None:
        """Write object ``key`` to ``target`` atomically."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        raise NotImplementedError

    # -- optional operations with portable defaults (the hosted server uses these) -----------

    def open_read(self, key: str):
        """A binary file object streaming object ``key`` (``read(n)``, ``close()``); the caller closes it.

        Raises :class:`KvcdnError` when the object does not exist. The default stages the object in
        a temp file that disappears when closed; backends that can stream override it.
        """
        staged = tempfile.TemporaryFile()
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "object"
            try:
                self.get_file(key, target)
            except BaseException:
                staged.close()
                raise
            with open(target, "rb") as fh:
                shutil.copyfileobj(fh, staged, 1 << 20)
        staged.seek(0)
        return staged

    def size_of(self, key: str) -> int | None:
        """Size of object ``key`` in bytes, or None when it does not exist."""
        for info in self.list(key):
            if info.key == key:
                return info.size
        return None

    def read_bytes(self, key: str) -> bytes | None:
        """The whole (small) object ``key``, or None when it does not exist."""
        if not self.exists(key):
            return None
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "object"
            self.get_file(key, target)
            return target.read_bytes()

    def write_bytes(self, key: str, data: bytes) -> None:
        """Store a small object atomically."""
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "object"
            source.write_bytes(data)
            self.put_file(key, source)

    def rename(self, source_key: str, target_key: str) -> None:
        """Move an object to another key (copy + delete where the medium has no rename)."""
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / "object"
            self.get_file(source_key, staged)
            self.put_file(target_key, staged)
        self.delete(source_key)

    def presigned_url(self, method: str, key: str, expires_in: int, size: int | None = None) -> str | None:
        """A URL that lets its holder ``PUT``/``GET`` one object without credentials until it expires.

        None when the medium has no such URLs (the hosted server then signs its own).
        """
        return None


def safe_key(key: str) -> str:
    """Refuse keys that could escape the storage root."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key:
        raise KvcdnError(f"invalid storage key '{key}'")
    return key


class LocalStorage(StorageBackend):
    """Objects as files under a root directory; writes go to a temp file and are renamed."""

    schemes = ("file",)

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @classmethod
    def from_uri(cls, uri: str) -> LocalStorage:
        parsed = urlparse(uri)
        return cls(parsed.path if parsed.scheme == "file" else uri)

    def path_of(self, key: str) -> Path:
        return self.root / safe_key(key)

    def put_file(self, key: str, source: Path) -> None:
        target = self.path_of(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(source, "rb") as fh:
            atomic_write_stream(target, fh)

    def get_file(self, key: str, target: Path) -> None:
        source = self.path_of(key)
        if not source.is_file():
            raise KvcdnError(f"no object '{key}' in {self.root}")
        with open(source, "rb") as fh:
            atomic_write_stream(Path(target), fh)

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def delete(self, key: str) -> None:
        self.path_of(key).unlink(missing_ok=True)

    def size_of(self, key: str) -> int | None:
        try:
            return self.path_of(key).stat().st_size
        except FileNotFoundError:
            return None

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self.path_of(key).read_bytes()
        except FileNotFoundError:
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        import io

        atomic_write_stream(self.path_of(key), io.BytesIO(data))

    def open_read(self, key: str):
        try:
            return open(self.path_of(key), "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise KvcdnError(f"no object '{key}' in {self.root}") from None

    def rename(self, source_key: str, target_key: str) -> None:
        target = self.path_of(target_key)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path_of(source_key), target)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        found = []
        if ".." in prefix.split("/") or prefix.startswith("/") or "\\" in prefix:
            raise KvcdnError(f"invalid storage prefix '{prefix}'")
        # Walk only the deepest directory the prefix names, not the whole root.
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not start.is_dir():
            return []
        for path in sorted(start.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    found.append(ObjectInfo(key, path.stat().st_size))
        return found


def atomic_write_stream(target: Path, stream, chunk: int = 1 << 20) -> int:
    """Copy a binary stream to ``target`` through a temp file in the same directory; return bytes."""
    with atomic_open(target) as out:
        shutil.copyfileobj(stream, out, chunk)
        written = out.tell()
    return written


def open_storage(uri: str) -> StorageBackend:
    """The backend for a URI, found through the storage hook; a bare path means local disk."""
    from kvcdn_core.plugins import get_host

    scheme = urlparse(uri).scheme if "://" in uri else "file"
    backends = get_host().storage_backends()
    cls = backends.get(scheme)
    if cls is None:
        known = ", ".join(sorted(backends)) or "none"
        raise KvcdnError(f"no storage backend for '{scheme}://' (installed: {known})")
    return cls.from_uri(uri)


@hookimpl
def kvcdn_register_storage_backends():
    return [LocalStorage]
