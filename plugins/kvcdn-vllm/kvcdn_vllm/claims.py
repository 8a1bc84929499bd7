"""Claims across processes on fetching a chunk into a shared tier directory.

Engines and tensor-parallel workers on one machine may share a tier directory (the default one is
shared). Each reads the chunk files the others wrote, but two that miss the same chunk at the same
moment, as the workers of one tensor-parallel step always do, would both fetch it from the store:
``tp`` workers, ``tp`` times the bytes.

So a tier with a disk level claims a chunk before it fetches it: an exclusive ``flock`` on the
chunk's claim file (``XX/.DIGEST.claim``, beside the chunk's file), held for the fetch. A tier that
finds the chunk claimed marks the claim wanted (one byte written into the file) and waits for it.
The holder, its fetch done, looks at the mark: wanted, it checks the chunk's digest and writes its
file at once (not queued behind the forward, as its disk copies otherwise are), then lets go;
otherwise it lets go at once. The waiter lets go too, then reads the file (waiters read it side by
side); when there is none (the holder's fetch failed or its disk could not take the file, the mark
came after the holder looked, the holder was killed: the kernel drops a dead process's locks), it
fetches the chunk itself, unclaimed, so that waiters never fetch one after another. Only a chunk
that fits the tier's disk budget is claimed (another could have no file). A claim is held for one
fetch and never while its holder waits for anything else, so two processes that each wait for a
chunk the other claimed never wait for each other. What a waiter gives up is streaming: it reads
the chunk once all of it is on disk, not as its bytes land. A waiter waits at most
:data:`LONGEST_WAIT_S`, then fetches for itself.

The holder removes the claim file before it lets go of the lock, and a claim counts only on the
file that is at the path when it is taken (a waiter that gets the lock of a removed file tries
again), so two processes never both hold a chunk's claim. A file a killed holder left is removed
by the next tier that starts on the directory and finds it unlocked (:func:`sweep_claims`). A
directory that cannot take a claim file (read-only, full) claims nothing: each process fetches for
itself, as without claims. No torch here.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

#: a chunk's claim file: ``.DIGEST.claim`` in the folder of its first two hex digits
CLAIM_NAME = re.compile(r"\.([0-9a-f]{64})\.claim")
#: the longest a tier waits for another process's claim on a chunk before it fetches it itself
#: (a chunk's fetch from a slow store and the write of its file: well under this)
LONGEST_WAIT_S = 5.0
#: how often a waiting tier tries the claim again
POLL_S = 0.002


def claim_path(directory: Path, digest: str) -> Path:
    return directory / digest[:2] / f".{digest}.claim"


class Claim:
    """A held claim on fetching one chunk; :meth:`release` once the fetch is done (and its file in
    place, when :attr:`wanted`). ``waited``: another process held it first (its file may be there now)."""

    def __init__(self, path: Path, fd: int, waited: bool):
        self.path = path
        self.waited = waited
        self._fd = fd
        self._lock = threading.Lock()
        #: a claim dropped unreleased (a bug) still lets go of its lock once it is collected
        self._closes = weakref.finalize(self, os.close, fd)

    @property
    def wanted(self) -> bool:
        """Whether another process marked the claim: it waits for the chunk's file."""
        with self._lock:
            return self._fd >= 0 and os.fstat(self._fd).st_size > 0

    def release(self) -> None:
        """Remove the claim file, then let go of the lock (a second call does nothing)."""
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd < 0:
            return
        self._closes.detach()
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)


class FetchClaims:
    """The claims of one tier directory. ``clock`` and ``sleep`` time the wait for a claim another
    process holds."""

    def __init__(
        self,
        directory: Path,
        longest_wait_s: float = LONGEST_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.directory = Path(directory)
        self.longest_wait_s = longest_wait_s
        self._clock = clock
        self._sleep = sleep

    def claim(self, digest: str) -> Claim | None:
        """The claim on fetching ``digest``, taken once no other process holds it; None when the
        directory takes no claim file, or another process held it past ``longest_wait_s``."""
        path = claim_path(self.directory, digest)
        waited, deadline = False, None
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                return None
            try:
                marked = False  # each file its holder's: a new holder is told too
                while not _locked(fd):
                    if not marked:
                        os.pwrite(fd, b"w", 0)  # wanted: the holder writes the file as soon as it can
                        marked = True
                    now = self._clock()
                    deadline = now + self.longest_wait_s if deadline is None else deadline
                    if now >= deadline:
                        os.close(fd)
                        return None
                    waited = True
                    self._sleep(POLL_S)
                if _same_file(fd, path):
                    return Claim(path, fd, waited)
            except OSError:
                os.close(fd)
                return None
            os.close(fd)  # the holder removed this file as it let go: the claim is on the path's new one


def hidden_files(directory: Path) -> list[Path]:
    """The files whose names start with a dot in the tier directory's ``XX`` folders (claim files
    and the disk copies' temporary files live there, beside the chunks' files)."""
    found: list[Path] = []
    try:
        folders = [sub for sub in directory.glob("??") if sub.is_dir()]
    except OSError:
        return found
    for sub in folders:
        try:
            found.extend(p for p in sub.iterdir() if p.name.startswith("."))
        except OSError:
            continue
    return found


def sweep_claims(directory: Path) -> int:
    """Remove the claim files that killed holders left under ``directory`` (one that is locked is
    held by a live process and stays); the number removed."""
    removed = 0
    for path in hidden_files(directory):
        if not CLAIM_NAME.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _locked(fd) and _same_file(fd, path):
                os.unlink(path)
                removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _locked(fd: int) -> bool:
    """Whether this descriptor took the file's exclusive lock (False: another holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        found = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)
