"""Saving prompts into a chunk store off the forward path: a bounded queue and one thread.

The forward step only hands over a prompt's gathered keys and values (already copied to CPU). The
thread writes them as an artifact in a scratch directory (:mod:`kvcdn_vllm.writer`, the same file
any kvcdn tool reads, each tensor hashed once for its manifest) and puts it into the store with
core's :meth:`ChunkStore.put`, which cuts it into chunks (hashing each byte once more) and uploads
only those the store lacks. That put skips its own check of the file against its manifest
(``verified``): this thread wrote the file a moment ago, in its own scratch directory.

Back pressure: when ``capacity`` saves wait already, a new one is skipped with one warning line
(the forward never waits for the store).
A save that fails (store unreachable, refusing, over quota, disk full) fails no request: the first
failure of a run is one warning line, the saves that fail after it are only counted (a store that
is down does not flood the log), and the first save that works again says so in one line.
The store is any chunk store with core's ``put`` (core's on a backend of bytes, or the hosted
service's own: :func:`kvcdn_core.store.chunkstore.open_chunk_store`).
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvcdn_core.store.chunkstore import ChunkStore, PutReport

#: ``write(directory) -> path``: writes one prompt's artifact into ``directory``.
Write = Callable[[Path], Path]


class Store(Protocol):
    """What the queue puts into: core's :class:`~kvcdn_core.store.chunkstore.ChunkStore` on a
    backend of bytes, or a backend's own chunk store (the hosted service's)."""

    def put(self, path: str | os.PathLike[str], name: str | None = None, force: bool = False) -> PutReport: ...


class SaveQueue:
    """Puts artifacts into ``store`` in the background, at most ``capacity`` waiting."""

    def __init__(
        self,
        store: Store,
        capacity: int,
        warn: Callable[[str], None],
        done: Callable[[str, PutReport], None] | None = None,
        info: Callable[[str], None] | None = None,
    ):
        self.store = store
        #: core's put can skip the manifest pass over a file this thread has just written
        self._verified = {"verified": True} if isinstance(store, ChunkStore) else {}
        self._warn = warn
        self._done = done
        self._info = info
        self._failing = 0  # saves failed since the last one that worked
        self._queue: queue.Queue[tuple[str, Write] | None] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._run, name="kvcdn-save", daemon=True)
        self._thread.start()
        self.saved = self.skipped = self.failed = 0
        self.bytes_moved = 0

    def submit(self, name: str, write: Write) -> bool:
        """Queue a save; False (and one warning line) when the queue is full."""
        try:
            self._queue.put_nowait((name, write))
            return True
        except queue.Full:
            self.skipped += 1
            self._warn(f"not saving {name}: {self._queue.maxsize} saves are already waiting for the store")
            return False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._save(*item)
            finally:
                self._queue.task_done()

    def _save(self, name: str, write: Write) -> None:
        try:
            with tempfile.TemporaryDirectory(prefix="kvcdn-save-") as scratch:
                path = write(Path(scratch))
                report = self.store.put(path, name, force=True, **self._verified)
        except Exception as exc:  # a store that fails must not stop the engine: one line, go on
            self.failed += 1
            self._failing += 1
            if self._failing == 1:
                detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
                self._warn(
                    f"not saving {name}: {detail} (saves that fail after this one are counted, not logged, "
                    "until one works again)"
                )
            return
        if self._failing and self._info is not None:
            self._info(f"saving to the store works again; {self._failing} saves failed meanwhile")
        self._failing = 0
        self.saved += 1
        self.bytes_moved += report.bytes_moved
        if self._done is not None:
            self._done(name, report)

    def join(self) -> None:
        """Wait until every queued save is done (tests, and engine shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
