"""Where the connector's artifacts live: a local directory, or a local mirror of a storage URI.

Prefix search works on a directory (its per-directory index keeps repeated searches cheap). A backend
that declares the ``local_path`` capability (a plain path, ``file://``, any plugin whose objects are
files here) is searched in place: the directory is the one holding its top-level objects
(``path_of``), and an artifact the connector saves there is already the object. Any other
``source`` (``s3://bucket/prefix``, the hosted service, any URI an installed kvcdn storage backend
serves) is mirrored into a per-user cache directory: new or changed ``.kv`` objects are downloaded
(atomically, by the backend) before a search, at most every :data:`SYNC_INTERVAL_S` seconds, and
artifacts the connector saves are uploaded back.
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
#: A top-level key: the parent of its ``path_of`` is the directory a ``local_path`` source is read in.
_TOP_LEVEL_KEY = "artifact.kv"


class Source:
    """The ``source`` of a connector: :attr:`directory` to search and save in, maybe a remote store."""

    def __init__(self, uri: str, create: bool = False, warn: Callable[[str], None] | None = None):
        from kvcdn_core import open_storage
        from kvcdn_core import warn as warn_person

        self.uri = uri
        self._warn = warn or warn_person
        self._last_sync = float("-inf")
        backend = open_storage(uri)
        if type(backend).offers("local_path"):  # declared: its objects are files here, read in place
            self.storage = None
            self.directory = backend.path_of(_TOP_LEVEL_KEY).parent.expanduser()
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
