"""The built-in storage backend: objects as files under a root directory (``file://`` or a path)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

from kvcdn_core import hookimpl
from kvcdn_core.atomic import atomic_write_stream
from kvcdn_core.contracts.storage import ObjectInfo, ObjectNotFound, StorageBackend, check_prefix, safe_key


class LocalStorage(StorageBackend):
    """Objects as files under a root directory; writes go to a temp file and are renamed.

    Temporary files start with ``.``, so listings skip names that do.
    """

    schemes = ("file",)
    capabilities = frozenset({"local_path"})

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    @classmethod
    def from_uri(cls, uri: str) -> LocalStorage:
        parsed = urlparse(uri)
        return cls(parsed.path if parsed.scheme == "file" else uri)

    def path_of(self, key: str) -> Path:
        """The object's file under the root (objects are plain files: ``local_path``)."""
        return self.root / safe_key(key)

    def put_file(self, key: str, source: Path) -> None:
        with open(source, "rb") as fh:
            atomic_write_stream(self.path_of(key), fh)

    def get_file(self, key: str, target: Path) -> None:
        with self.open_read(key) as fh:
            atomic_write_stream(Path(target), fh)

    def open_read(self, key: str) -> IO[bytes]:
        try:
            return open(self.path_of(key), "rb")  # noqa: SIM115 - the caller closes it
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(f"no object '{key}' in {self.root}") from None

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def delete(self, key: str) -> None:
        self.path_of(key).unlink(missing_ok=True)

    def size_of(self, key: str) -> int | None:
        path = self.path_of(key)
        return path.stat().st_size if path.is_file() else None

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self.path_of(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        atomic_write_stream(self.path_of(key), io.BytesIO(data))

    def rename(self, source_key: str, target_key: str) -> None:
        source = self.path_of(source_key)
        target = self.path_of(target_key)
        if not source.is_file():
            raise ObjectNotFound(f"no object '{source_key}' in {self.root}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names, not the whole root.
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not start.is_dir():
            return []
        found = []
        for path in start.rglob("*"):
            key = path.relative_to(self.root).as_posix()
            if path.name.startswith(".") or not key.startswith(prefix):
                continue
            try:  # an object renamed or deleted by another thread meanwhile is simply not listed
                if path.is_file():
                    found.append(ObjectInfo(key, path.stat().st_size))
            except FileNotFoundError:
                continue
        return sorted(found, key=lambda info: info.key)


@hookimpl
def kvcdn_register_storage_backends() -> list[type[StorageBackend]]:
    return [LocalStorage]
