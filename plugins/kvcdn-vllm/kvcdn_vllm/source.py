"""Where the connector's artifacts live: a local directory, or a local mirror of a storage URI.

Prefix search works on a directory (its per-directory index keeps repeated searches cheap), so a
``source`` that is not a local path (``s3://bucket/prefix``, the hosted service, any URI an installed
kvcdn storage backend serves) is mirrored into a per-user cache directory: new or changed ``.kv``
objects are downloaded (atomically, by the backend) before a search, at most every
:data:`SYNC_INTERVAL_S` seconds, and artifacts the connector saves are uploaded back.
No torch here: the scheduler side uses this module.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from kvcdn_core import KvcdnError, cache_home

#: Seconds between two listings of a remote source.
SYNC_INTERVAL_S = 30.0


class Source:
    """The ``source`` of a connector: :attr:`directory` to search and save in, maybe a remote store."""

    def __init__(self, uri: str, create: bool = False, warn: Callable[[str], None] | None = None):
        from kvcdn_core import LocalStorage, open_storage
        from kvcdn_core import warn as warn_person

        self.uri = uri
        self._warn = warn or warn_person
        self._last_sync = float("-inf")
        backend = open_storage(uri)
        if isinstance(backend, LocalStorage):
            self.storage = None
            self.directory = Path(backend.root).expanduser()
        else:
            self.storage = backend
            digest = hashlib.sha256(uri.encode()).hexdigest()[:24]
            self.directory = cache_home() / "vllm-mirror" / digest
            create = True
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        elif not self.directory.is_dir():
            raise KvcdnError(f"source directory '{self.directory}' does not exist")

    def sync(self, force: bool = False) -> None:
        """Bring new or changed remote artifacts into the mirror (no-op for a local directory)."""
        if self.storage is None or (not force and time.monotonic() - self._last_sync < SYNC_INTERVAL_S):
            return
        self._last_sync = time.monotonic()
        try:
            objects = [o for o in self.storage.list("") if o.key.endswith(".kv")]
        except Exception as exc:  # an unreachable store must not stop the engine
            self._warn(f"cannot list {self.uri}: {exc}")
            return
        for obj in objects:
            target = self.directory / obj.key
            try:
                if target.is_file() and target.stat().st_size == obj.size:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                self.storage.get_file(obj.key, target)
            except Exception as exc:
                self._warn(f"cannot fetch {obj.key} from {self.uri}: {exc}")

    def publish(self, path: Path) -> None:
        """Upload an artifact written into :attr:`directory` to the remote store, if there is one."""
        if self.storage is not None:
            self.storage.put_file(path.relative_to(self.directory).as_posix(), path)
