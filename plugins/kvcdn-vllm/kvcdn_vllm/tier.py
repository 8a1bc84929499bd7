"""The local tier of a chunk store: chunks kept in memory and on disk, each under a byte budget.

A chunk is named by the BLAKE3 digest of its bytes. Its digest is checked once, where it enters the
tier: when it comes from the store, and when it is first read from disk by this process (a file
left by an earlier run or by another process sharing the directory). A chunk fetched with
``check_later`` enters only when :meth:`ChunkTier.admit` has checked it: the connector copies it into
vLLM's blocks first and checks it beside the forward. A chunk that passed is
trusted from then on: the worker copies its bytes into vLLM's cache without hashing them again.
A file that fails the check is deleted with one warning line and the chunk is fetched again. A
chunk neither in memory nor among the files this process knows is looked for in the directory
before it is fetched (:meth:`ChunkTier._adopt`), and a fetch is claimed across the processes
sharing the directory (:mod:`kvcdn_vllm.claims`), so that they fetch each chunk once. Files
are mapped, not read (:func:`_mapped` says why), and the memory level keeps the mapping; a mapped
file that the disk level deletes frees its space once the memory level drops it too.

Both levels evict the least recently used chunk first, and never a pinned one: a request pins the
chunks of its load plan until they are in its blocks, so a fetch for the same or another request
cannot evict them halfway (a level may then sit over its budget until they are unpinned). A disk
that cannot take a chunk (full, read-only) costs one warning line; the chunk is still served.

The connector takes a step's chunks through :meth:`ChunkTier.arrive_all`, which hands each out
at once as an :class:`Arrival` while the tier reads or fetches the missing ones side by side; a
fetch tells its arrival how many bytes are in place as they land, so the connector copies a
chunk's first layers while its last ones are still on the way, and checks it once it is whole.

A chunk fetched from the store is read into memory that is already touched
(:class:`TouchedBuffers`, says why) and served from memory at once; its disk copy is written by one
background thread (:class:`DiskWriter`), so the load never waits for the disk. Until its file is
in place the chunk is served from the bytes waiting to be written. Back pressure: at most
``write_queue_bytes`` of copies wait (the ``tier_write_queue_bytes`` setting); past that a copy is not made (one warning line per run, the
rest counted in ``disk_dropped``) and the chunk lives in memory only. A copy is written under a
temporary name and renamed into place, so a half-written file is never taken for a chunk; it is
not fsynced: a file an earlier run left is hashed the first time it is read anyway, so one torn by
a crash is dropped and fetched again. :meth:`ChunkTier.close` waits for the queued copies.
The temporary name carries the writer's process id; at start the tier removes the temporary files
that killed writers left (:func:`sweep_temp_files`).

A restarted engine's memory level starts empty while its disk level holds what the last run used.
:meth:`ChunkTier.warm` maps and checks the most recently used files into the free part of the
memory budget (never evicting), so the first requests after a restart are served from memory as
later ones are; the connector runs it on one background thread at a lower priority
(:meth:`ChunkTier.start_warming`), and a request that needs a chunk first simply reads it itself.
The tier's background work (disk copies, buffer refills, warming) also stands aside while a step's
chunk loads are in flight (:class:`StandAside`): the connector holds it from the fetches to the end
of the copies and checks under the forward, and each unit of background work waits for it, at most
:data:`LONGEST_STAND_ASIDE_S`, before it starts and between its pieces of :data:`BACKGROUND_STEP`
bytes. No torch here.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from kvcdn_core import ArtifactError
from kvcdn_core.store.pack import checked
from kvcdn_core.store.record import HEX64
from kvcdn_vllm.claims import FetchClaims, hidden_files, sweep_claims

#: A chunk's bytes: fetched ones in memory, files of the disk level mapped (see :func:`_mapped`).
ChunkBytes = bytes | memoryview

#: Where a chunk came from, as the per-request figures count them.
MEMORY, DISK, REMOTE = "memory", "disk", "remote"

#: chunks :meth:`ChunkTier.arrive_all` gets at once (each a request of its own to the store)
FETCH_STREAMS = 4

#: bytes of disk copies that may wait for the writer by default; past it a fetched chunk gets no
#: disk copy (``tier_write_queue_bytes`` in :mod:`kvcdn_vllm.settings` sets it per engine)
WRITE_QUEUE_BYTES = 1 << 30


#: a disk copy's temporary name (:meth:`ChunkTier._write_file`): digest, writer's pid, thread id
TEMP_NAME = re.compile(r"\.([0-9a-f]{64})\.([0-9]+)\.([0-9]+)\.tmp")
#: a temporary file whose writer's pid is gone is swept once it is this old (a writer in another pid
#: namespace sharing the directory may look gone while it writes, and a copy takes milliseconds)
TEMP_DEAD_WRITER_S = 60.0
#: a temporary file this old is swept whatever its pid says (the pid may belong to a new process)
TEMP_MAX_AGE_S = 3600.0


def sweep_temp_files(directory: Path, now: float) -> int:
    """Remove the disk copies' temporary files that killed writers left under ``directory`` (only
    the tier's own name pattern, one level down, as the copies are written), never one a running
    writer may still be writing; the number removed. They count against no budget and are never read,
    so without this they would stay forever."""
    removed = 0
    for path in hidden_files(directory):
        match = TEMP_NAME.fullmatch(path.name)
        if match is None or not match.group(1).startswith(path.parent.name):
            continue
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue
        stale = age > TEMP_MAX_AGE_S or (age > TEMP_DEAD_WRITER_S and not _alive(int(match.group(2))))
        if stale:
            try:
                path.unlink()
                removed += 1
            except OSError:  # gone meanwhile (another engine swept it), or not ours to remove
                pass
    return removed


def _mapped(path: Path) -> memoryview:
    """The file's bytes, mapped read-only rather than read.

    Why: a read copies the chunk into memory the process has not touched yet, and first touches are
    what a fresh engine's load pays most for (on the benchmark's machine 3-4 ms per MB inside the
    engine, against 0.5 ms for hashing and mapping pages the page cache already holds). The digest
    is checked on the mapped bytes, the very bytes then copied into vLLM's blocks. The tier only ever
    replaces a file by renaming another over it, which a mapping does not see, and deletes files,
    which a mapping outlives; a file truncated in place by another program while mapped would stop
    the engine (SIGBUS), as with any mapped file.
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # nothing to map: an empty file fails the check as it is
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


#: how much nicer than the engine the tier's background threads run
BACKGROUND_NICE = 10


def _lower_priority() -> None:
    """Nice the calling thread (Linux nices threads one by one), so that background work yields the
    core to the forward; best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


def _alive(pid: int) -> bool:
    """Whether a process of that id runs on this machine (signal 0 checks without sending)."""
    if pid <= 0:  # 0 and negatives name process groups, not a writer
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, OSError):
        return False
    return True


#: the longest one unit of background work (a disk copy, a buffer) waits for loads in flight, so
#: that an engine that loads in every step still gets its copies and buffers, later
LONGEST_STAND_ASIDE_S = 0.5

#: a unit of background work (a chunk's disk copy, a buffer's first writes) goes this many bytes at a
#: time, standing aside between them: a load that starts while a chunk is being written waits for
#: at most this much of it, not the whole chunk
BACKGROUND_STEP = 1 << 20


class StandAside:
    """Held while a step's chunks are fetched and copied under the forward, and while the scheduler
    looks a prompt up; the tier's background threads wait for it before each unit of work and
    between its pieces. Each holder (any key: the connector, its role) holds and releases its own
    hold; the background goes on once none is held. A closing tier excuses its own background work
    (:meth:`excuse`) without touching the holds, which other tiers of the process may still heed.

    Why: a lower priority was not enough. In the fleet benchmark (2 cores) the disk copies and
    buffer refills that one remote request set off ran beside its forward, and that forward took
    0.18-0.23 s where a request served from memory took 0.12 s; without them, 0.14 s. Nice 10 yields
    the core, not the page faults, the memory traffic and the address-space lock that new buffers
    and file writes take.
    """

    def __init__(self, longest_s: float = LONGEST_STAND_ASIDE_S, clock: Callable[[], float] = time.monotonic):
        self.longest_s = longest_s
        self._clock = clock
        self._changed = threading.Condition()
        self._holders: set[object] = set()
        self.waiting = 0  # background threads standing aside now

    def hold(self, holder: object = None) -> None:
        with self._changed:
            self._holders.add(holder)

    def release(self, holder: object = None) -> None:
        with self._changed:
            self._holders.discard(holder)
            if not self._holders:
                self._changed.notify_all()

    @property
    def held(self) -> bool:
        return bool(self._holders)

    def excuse(self, excused: threading.Event) -> None:
        """From now on, the work that waits with ``excused`` goes on at once (its tier closes: the
        queued copies go now); the holds stay, and the rest of the background still heeds them."""
        with self._changed:
            excused.set()
            self._changed.notify_all()

    def wait(self, longest_s: float | None = None, excused: threading.Event | None = None) -> None:
        """Return once nothing is held, ``excused`` is set, or after ``longest_s`` (default
        :attr:`longest_s`)."""
        if not self._holders:
            return

        def free() -> bool:
            return not self._holders or (excused is not None and excused.is_set())

        with self._changed:
            if free():
                return
            self.waiting += 1
            try:
                self._changed.wait_for(free, self.longest_s if longest_s is None else max(0.0, longest_s))
            finally:
                self.waiting -= 1

    def pauses(self, excused: threading.Event | None = None) -> Callable[[], None]:
        """The pause between the pieces of one unit of work (:data:`BACKGROUND_STEP` bytes each):
        each returns once nothing is held or ``excused`` is set, or :attr:`longest_s` after this
        call (the unit's start)."""
        deadline = self._clock() + self.longest_s
        return lambda: self.wait(deadline - self._clock(), excused)


#: one per process: vLLM runs a single worker in its scheduler's process, so the scheduler's lookups
#: make that worker's tier stand aside as its loads do (the lookup took 10-15 ms beside a fetch's
#: disk copies and refills, about 6 ms without)
PROCESS_STAND_ASIDE = StandAside()


class Writer(Protocol):
    """Runs the tier's disk writes off the load path (each job handles its own errors)."""

    def submit(self, job: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


class DiskWriter:
    """One daemon thread running submitted jobs in order; started by the first job."""

    def __init__(
        self,
        warn: Callable[[str], None],
        name: str = "kvcdn-tier-write",
        stand_aside: StandAside | None = None,
        excused: threading.Event | None = None,
    ):
        self._warn = warn
        self._name = name
        self._stand_aside = stand_aside
        self._excused = excused if excused is not None else threading.Event()  # set by close
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def _run(self) -> None:
        _lower_priority()  # the copies are for later runs: the forward comes first
        while (job := self._jobs.get()) is not None:
            if self._stand_aside is not None:
                self._stand_aside.wait(excused=self._excused)
            try:
                job()
            except Exception as exc:  # a bug must not stop the writer: later copies still go
                self._warn(f"writing the local tier failed: {exc!r}")

    def close(self) -> None:
        """Run the queued jobs at once, then stop the thread (a later job starts a new one)."""
        if self._stand_aside is not None:
            self._stand_aside.excuse(self._excused)
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join()


#: the buffers kept ready take at most this share of the memory level's budget, and this many bytes
RESERVE_SHARE = 8
RESERVE_MAX_BYTES = 256 << 20


class TouchedBuffers:
    """Buffers of ``size`` bytes (a whole chunk of the engine's model) whose pages are already
    written, ``count`` of them kept ready by one background thread at a lower priority; a fetch from
    the store reads a chunk into one.

    Why: a chunk read into new memory pays the first write of each of its pages on the load path, and
    inside an engine that cost more than the read itself (3-4 ms per MB on the benchmark's 2-core
    machine, where a remote request's load went mostly to it). LMCache preallocates its CPU buffer
    for the same reason. A part of at most half the size (a piece) gets new memory, so that no
    buffer held by the memory level is mostly unused.
    """

    def __init__(self, size: int, count: int, stand_aside: StandAside | None = None):
        self.size = size
        self.count = count
        self._stand_aside = stand_aside
        self.taken = 0  # buffers handed out ready
        self._ready: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        if size > 0 and count > 0:
            self._wanted.set()
            self._thread = threading.Thread(target=self._fill, name="kvcdn-tier-buffers", daemon=True)
            self._thread.start()

    @classmethod
    def for_budget(cls, size: int, memory_bytes: int, stand_aside: StandAside | None = None) -> TouchedBuffers:
        """As many buffers of ``size`` as an eighth of ``memory_bytes`` holds, at most 256 MiB."""
        count = min(memory_bytes // RESERVE_SHARE, RESERVE_MAX_BYTES) // size if size > 0 else 0
        return cls(size, count, stand_aside)

    def take(self, n: int) -> memoryview:
        """``n`` bytes to read a chunk into: the front of a ready buffer when one is ready and ``n``
        is more than half of it, else new memory."""
        if self.size // 2 < n <= self.size:
            with self._lock:
                buffer = self._ready.pop() if self._ready else None
                self.taken += buffer is not None
            if buffer is not None:
                self._wanted.set()
                return memoryview(buffer)[:n]
        return memoryview(bytearray(n))

    @property
    def ready(self) -> int:
        return len(self._ready)

    def _fill(self) -> None:
        _lower_priority()
        try:
            while not self._closing.is_set():
                self._wanted.wait()
                self._wanted.clear()
                while not self._closing.is_set() and len(self._ready) < self.count:
                    aside = self._stand_aside
                    if aside is not None:
                        aside.wait(excused=self._closing)
                    buffer = _touched(self.size, aside.pauses(self._closing) if aside is not None else None)
                    with self._lock:
                        self._ready.append(buffer)
        except (OSError, MemoryError, ValueError):  # no memory for more: fetches read into new memory
            return

    def close(self) -> None:
        """Stop the filling thread and let the ready buffers go."""
        if self._stand_aside is not None:
            self._stand_aside.excuse(self._closing)
        else:
            self._closing.set()
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._ready.clear()


def _touched(size: int, pause: Callable[[], None] | None = None) -> mmap.mmap:
    """``size`` bytes of new memory with every page written, without holding Python's lock: a
    ctypes call releases it, where ``bytearray(size)`` would hold it through the whole memset (40 ms
    for a chunk here) and the load on the engine's thread would wait for it. ``pause`` runs between
    the :data:`BACKGROUND_STEP` pieces written."""
    buffer = mmap.mmap(-1, size)
    start = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(start)
    for offset in range(0, size, BACKGROUND_STEP):
        if pause is not None and offset:
            pause()
        ctypes.memset(address + offset, 0, min(BACKGROUND_STEP, size - offset))
    del start  # releases the buffer it exported
    return buffer


class Arrival:
    """A chunk on its way to a reader (:meth:`ChunkTier.arrive_all`): its bytes once known, how
    many of them are in place, and where it came from (``where``, None until it settled). A reader
    waits only for the bytes it needs (:meth:`wait`); a fetch into the tier's memory makes its
    front readable while the rest is still arriving."""

    def __init__(self, size: int):
        self.size = size
        self.where: str | None = None
        self._data: ChunkBytes | None = None
        self._landed = 0
        self._settled = False
        self._error: ArtifactError | None = None
        self._changed = threading.Condition()

    def landing(self, into: memoryview) -> Callable[[int], None]:
        """The ``landed`` callback of a fetch into ``into``: its first ``n`` bytes are readable."""

        def landed(n: int) -> None:
            with self._changed:
                self._data, self._landed = into, n
                self._changed.notify_all()

        return landed

    def settle(self, data: ChunkBytes, where: str) -> None:
        """All of it is here: ``data`` (the memory it streamed into, if it did), from ``where``."""
        with self._changed:
            if self._data is not None and data is not self._data:
                # read into the tier's memory but not the size planned: what landed is not the chunk
                self._error = ArtifactError(f"the store: a chunk of {self.size} bytes came as {len(data)}")
            else:
                self.where = where
            self._data, self._landed, self._settled = data, len(data), True
            self._changed.notify_all()

    def fail(self, error: ArtifactError) -> None:
        with self._changed:
            self._error, self._settled = error, True
            self._changed.notify_all()

    def wait(self, n: int) -> ChunkBytes:
        """The chunk's bytes once their first ``n`` are in place; its :class:`ArtifactError` when
        it could not be had."""
        with self._changed:
            while not self._settled and (self._data is None or self._landed < n):
                self._changed.wait()
            if self._error is not None:
                raise self._error
            assert self._data is not None
            return self._data

    def wait_settled(self) -> ChunkBytes:
        """The chunk's bytes once the fetch is over (its end read and judged: a body longer than
        planned is refused only then); its :class:`ArtifactError` when it could not be had."""
        with self._changed:
            while not self._settled:
                self._changed.wait()
        return self.wait(self.size)

    @property
    def settled(self) -> bool:
        return self._settled


class ChunkTier:
    """``get(digest, size)`` → the chunk's checked bytes and where they came from.

    ``fetch(digest, into)`` returns the chunk's bytes from the store, read into ``into`` (``size``
    bytes of memory from ``buffers``, or new) where the source can, or None when the store lacks it.
    ``directory`` None (or ``disk_bytes`` 0) keeps no disk level. ``writer`` runs the disk writes
    (default: a :class:`DiskWriter` thread that stands aside for ``stand_aside``, as warming does).
    """

    def __init__(
        self,
        fetch: Callable[..., ChunkBytes | None],
        memory_bytes: int,
        disk_bytes: int,
        directory: Path | None,
        warn: Callable[[str], None],
        writer: Writer | None = None,
        write_queue_bytes: int = WRITE_QUEUE_BYTES,
        buffers: TouchedBuffers | None = None,
        stand_aside: StandAside | None = None,
        claims: FetchClaims | None = None,
    ):
        self._fetch = fetch
        self.stand_aside = stand_aside if stand_aside is not None else StandAside()
        self._buffers = buffers
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes if directory is not None else 0
        self.directory = Path(directory) if directory is not None else None
        self._warn = warn
        self._lock = threading.RLock()
        self._memory: collections.OrderedDict[str, ChunkBytes] = collections.OrderedDict()
        self._memory_used = 0
        self._disk: collections.OrderedDict[str, int] = collections.OrderedDict()  # digest → size, LRU first
        self._disk_used = 0
        self._verified: set[str] = set()  # disk files this process wrote or checked
        self._pins: collections.Counter[str] = collections.Counter()
        self._disk_warned = False
        self._closing = threading.Event()  # set by close: warming stops, the background stops standing aside
        self._writer = (
            writer if writer is not None else DiskWriter(warn, stand_aside=self.stand_aside, excused=self._closing)
        )
        self.write_queue_bytes = write_queue_bytes
        self._waiting: dict[str, ChunkBytes] = {}  # chunks whose disk copy is queued, not yet in place
        self._unchecked: dict[str, ChunkBytes] = {}  # fetched with check_later, not yet admitted
        self._arriving: dict[str, Arrival] = {}  # being read or fetched for arrive_all
        self._waiting_bytes = 0
        self.disk_dropped = 0  # copies not made because the queue was full
        self.temp_swept = 0  # temporary files of killed writers removed at start
        self.warmed = 0  # chunks :meth:`warm` brought from disk into memory
        self._warming: threading.Thread | None = None
        self._fetcher: ThreadPoolExecutor | None = None  # arrive_all's streams, started by the first
        #: claims on fetches, shared with the other processes on the directory (:mod:`kvcdn_vllm.claims`)
        self._claims: FetchClaims | None = None
        self.fetches_shared = 0  # chunks read from disk after waiting for another process's fetch
        if self.disk_bytes > 0 and self.directory is not None:
            self._claims = claims if claims is not None else FetchClaims(self.directory)
            self._scan()

    def close(self) -> None:
        """Stop warming, then wait for the queued disk copies (an engine's shutdown: the next start
        finds them)."""
        self.stand_aside.excuse(self._closing)  # warming stops, the queued copies go at once; the holds stay
        if self._warming is not None:
            self._warming.join()
        if self._buffers is not None:
            self._buffers.close()
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
        self._writer.close()

    # -- warm start --------------------------------------------------------------------------------

    def warm(self) -> int:
        """Bring the most recently used disk chunks into the memory level, each checked as any file
        read first, as many as fit in its free budget; returns how many. Nothing is evicted for them,
        and they keep the disk level's order, so the least recently used is still dropped first."""
        with self._lock:
            free = self.memory_bytes - self._memory_used
            chosen = []
            for digest, size in reversed(self._disk.items()):  # most recently used first
                if digest in self._memory:
                    continue
                if size > free:
                    break
                chosen.append((digest, size))
                free -= size
        brought = 0
        for digest, size in reversed(chosen):  # least recent first: each goes to the memory's end
            self.stand_aside.wait(excused=self._closing)
            if self._closing.is_set():
                break
            data = self._from_disk(digest, size)
            if data is not None and self._keep_in_memory(digest, data, evict=False):
                brought += 1
        self.warmed += brought
        return brought

    def start_warming(self) -> None:
        """Run :meth:`warm` on a background thread at a lower priority (an engine's start)."""
        if self.memory_bytes <= 0 or not self._disk or self._warming is not None:
            return

        def run() -> None:
            _lower_priority()
            try:
                self.warm()
            except Exception as exc:  # a bug here must not stop the engine: requests read the disk
                self._warn(f"warming the local tier's memory level failed: {exc!r}")

        self._warming = threading.Thread(target=run, name="kvcdn-tier-warm", daemon=True)
        self._warming.start()

    # -- pins --------------------------------------------------------------------------------------

    def pin(self, digests: Iterable[str]) -> None:
        with self._lock:
            self._pins.update(digests)

    def unpin(self, digests: Iterable[str]) -> None:
        with self._lock:
            self._pins.subtract(digests)
            self._pins += collections.Counter()  # drop zero counts

    # -- reading -----------------------------------------------------------------------------------

    def get(
        self, digest: str, size: int, check_later: bool = False, arrival: Arrival | None = None
    ) -> tuple[ChunkBytes, str]:
        """The chunk's bytes (checked once) and ``memory``, ``disk`` or ``remote``; :class:`ArtifactError`
        (one line) when the store lacks it or holds other bytes under its name.

        With ``check_later``, a chunk fetched from the store is returned before its digest is
        checked and kept nowhere yet: the caller copies it, then calls :meth:`admit`, which checks it
        and only then lets it into the tier (the connector checks under the forward, and a chunk that
        fails costs its request a recompute). ``arrival`` is told as a fetched chunk's bytes land
        (:meth:`arrive_all`)."""
        with self._lock:
            unchecked = self._unchecked.get(digest)
        if unchecked is not None and len(unchecked) == size:  # fetched for another request of this step
            if not check_later:
                self.admit(digest, size)
            return unchecked, MEMORY
        with self._lock:
            data = self._memory.get(digest)
            if data is not None and len(data) == size:
                self._memory.move_to_end(digest)
                return data, MEMORY
            data = self._waiting.get(digest)  # checked when fetched; its file is not written yet
        if data is not None and len(data) == size:
            self._keep_in_memory(digest, data)
            return data, MEMORY
        data = self._from_disk(digest, size)
        if data is not None:
            self._keep_in_memory(digest, data)
            return data, DISK
        # a chunk that could have a file here is claimed for its fetch (one over the budget never has)
        claim = self._claims.claim(digest) if self._claims is not None and size <= self.disk_bytes else None
        try:
            if claim is not None and claim.waited:
                # another process fetched it: its file, if it could write one, is in place. Let go
                # first, so that the next waiter reads (and checks) it beside this one, and without
                # a file fetch unclaimed, so that waiters do not fetch one after another.
                claim.release()
                claim = None
                data = self._from_disk(digest, size)
                if data is not None:
                    with self._lock:
                        self.fetches_shared += 1
            elif claim is not None:
                data = self._from_disk(digest, size)  # written between the first look and the claim
            if data is not None:
                self._keep_in_memory(digest, data)
                return data, DISK
            into = self._buffers.take(size) if self._buffers is not None else memoryview(bytearray(size))
            try:
                landing = arrival.landing(into) if arrival is not None else None
                fetched = self._fetch(digest, into) if landing is None else self._fetch(digest, into, landing)
            except Exception as exc:  # any backend's error (a network one too) is a failed load, one line
                detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
                raise ArtifactError(f"cannot fetch chunk {digest} from the store: {detail}") from None
            if claim is not None and fetched is not None and claim.wanted:
                # another process waits for this chunk: checked, kept and written now, whatever
                # check_later says, so that its claim goes as soon as the file is in place
                data = checked(fetched, digest, size, "the store")
                self._keep_in_memory(digest, data)
                self._write_file(digest, data, pause=False)
                return data, REMOTE
        finally:
            if claim is not None:  # held for the fetch alone: never while waiting for anything else
                claim.release()
        if check_later and fetched is not None:
            with self._lock:
                self._unchecked[digest] = fetched
            return fetched, REMOTE
        data = checked(fetched, digest, size, "the store")
        self._keep(digest, data)
        return data, REMOTE

    def arrive_all(self, wanted: Sequence[tuple[str, int]]) -> list[Arrival]:
        """Each ``(digest, size)`` of ``wanted`` as an :class:`Arrival`, in order, returned at once.
        A chunk in memory is settled already; the others are read from disk or fetched from the
        store (as :meth:`get` with ``check_later``: :meth:`admit` checks them) up to
        :data:`FETCH_STREAMS` at once, a fetched one readable as its bytes land. A chunk that cannot
        be had fails its arrival with its :class:`ArtifactError` (one line), the others unaffected.
        A chunk already arriving for an earlier call is not asked for again: its arrival is shared.

        Why at once: a chunk from the store costs a request's latency as well as its bytes, and one
        stream at a time pays every latency in turn while the link idles between bodies. Why
        arrivals: a chunk holds every layer of its tokens, first layers first, so the connector
        copies a chunk's first layers into vLLM's blocks under the forward while its last ones are
        still on the way, instead of waiting for every byte of every chunk before the forward."""
        arrivals: dict[tuple[str, int], Arrival] = {}
        for digest, size in dict.fromkeys(wanted):
            with self._lock:
                arrival = self._arriving.get(digest)
                if arrival is not None and arrival.size == size:  # already on its way: shared
                    arrivals[(digest, size)] = arrival
                    continue
                arrival = arrivals[(digest, size)] = Arrival(size)
                held = digest in self._memory or digest in self._waiting or digest in self._unchecked
                if not held:
                    self._arriving[digest] = arrival
                if self._fetcher is None:
                    self._fetcher = ThreadPoolExecutor(FETCH_STREAMS, thread_name_prefix="kvcdn-fetch")
            if held:  # no wait: settled here and now
                self._arrive(digest, size, arrival)
                continue
            try:
                self._fetcher.submit(self._arrive, digest, size, arrival)
            except RuntimeError as exc:  # the pool is shut down (the engine is stopping)
                self._arrive_failed(digest, arrival, ArtifactError(f"cannot fetch chunk {digest}: {exc}"))
        return [arrivals[item] for item in wanted]

    def _arrive_failed(self, digest: str, arrival: Arrival, error: ArtifactError) -> None:
        arrival.fail(error)
        self._forget_arrival(digest, arrival)

    def _forget_arrival(self, digest: str, arrival: Arrival) -> None:
        """``arrival`` is no longer on its way: a later call asks for the chunk afresh."""
        with self._lock:
            if self._arriving.get(digest) is arrival:
                del self._arriving[digest]

    def _arrive(self, digest: str, size: int, arrival: Arrival) -> None:
        try:
            data, where = self.get(digest, size, check_later=True, arrival=arrival)
        except ArtifactError as exc:
            arrival.fail(exc)
        except BaseException as exc:  # a bug must not leave a reader waiting
            arrival.fail(ArtifactError(f"cannot get chunk {digest}: {exc!r}"))
            raise
        else:
            arrival.settle(data, where)
        finally:
            self._forget_arrival(digest, arrival)

    def admit(self, digest: str, size: int) -> None:
        """Check a chunk :meth:`get` fetched with ``check_later`` and keep it in both levels (one
        still arriving is waited for); :class:`ArtifactError` (one line) when its bytes are not the
        chunk's or it did not arrive, and it is dropped."""
        with self._lock:
            arrival = self._arriving.get(digest)
        try:
            if arrival is not None:  # all of it, not just its bytes: its end is checked too
                arrival.wait_settled()
        finally:  # what did come is dropped unless it passes the check below
            with self._lock:
                data = self._unchecked.pop(digest, None)
        if data is not None:
            self._keep(digest, checked(data, digest, size, "the store"))

    def _keep(self, digest: str, data: ChunkBytes) -> None:
        """A chunk checked as it came from the store: into memory, and its disk copy queued."""
        self._keep_in_memory(digest, data)
        self._queue_disk_copy(digest, data)

    def _path(self, digest: str) -> Path:
        assert self.directory is not None
        return self.directory / digest[:2] / digest

    def _from_disk(self, digest: str, size: int) -> ChunkBytes | None:
        if not self.on_disk(digest) and not self._adopt(digest):
            return None
        with self._lock:
            if digest not in self._disk:  # dropped meanwhile (another thread's eviction)
                return None
            self._disk.move_to_end(digest)
            trusted = digest in self._verified
        try:
            data = _mapped(self._path(digest))
            os.utime(self._path(digest))  # the LRU order an engine restart finds
        except OSError:
            self._drop_file(digest)
            return None
        if not trusted:
            try:
                checked(data, digest, size, f"the local tier ({self.directory})")
            except ArtifactError as exc:
                self._warn(f"{exc}; dropped, fetching it again")
                self._drop_file(digest)
                return None
            with self._lock:
                self._verified.add(digest)
        elif len(data) != size:
            self._drop_file(digest)
            return None
        return data

    def _adopt(self, digest: str) -> bool:
        """Count a chunk file this process did not find at start nor write (another engine or
        tensor-parallel worker sharing the directory wrote it since) as one of the disk level's,
        unchecked until read; whether there is one. Without this a chunk a neighbour fetched a
        moment ago would be fetched from the store again, until the next restart found it."""
        if self.disk_bytes <= 0 or self.directory is None:
            return False
        try:
            found = os.stat(self._path(digest))
        except OSError:
            return False
        if found.st_size > self.disk_bytes:  # another engine's budget: counting it would evict every other file
            return False
        self._count_on_disk(digest, found.st_size, verified=False)
        return True

    # -- keeping -----------------------------------------------------------------------------------

    def _keep_in_memory(self, digest: str, data: ChunkBytes, evict: bool = True) -> bool:
        """Keep the chunk as the most recently used, evicting others over the budget; with ``evict``
        False only if it fits as it is. Whether it is kept."""
        if len(data) > self.memory_bytes:
            return False
        with self._lock:
            if digest not in self._memory:
                if not evict and self._memory_used + len(data) > self.memory_bytes:
                    return False
                self._memory[digest] = data
                self._memory_used += len(data)
            self._memory.move_to_end(digest)
            for victim in [d for d in self._memory if d != digest and not self._pins[d]]:
                if self._memory_used <= self.memory_bytes:
                    break
                self._memory_used -= len(self._memory.pop(victim))
        return True

    def _queue_disk_copy(self, digest: str, data: ChunkBytes) -> None:
        """Hand the chunk to the writer, unless it is on disk or queued already, or the queue is full."""
        if len(data) > self.disk_bytes:
            return
        with self._lock:
            if digest in self._disk or digest in self._waiting:
                return
            queued = self._waiting_bytes + len(data) <= self.write_queue_bytes
            if queued:
                self._waiting[digest] = data
                self._waiting_bytes += len(data)
            else:
                self.disk_dropped += 1
            first_drop = not queued and self.disk_dropped == 1
        if queued:
            self._writer.submit(functools.partial(self._keep_on_disk, digest, data))
        elif first_drop:
            self._warn(
                f"the local tier's disk writes fall behind ({self.write_queue_bytes} bytes waiting); "
                "chunks fetched meanwhile are kept in memory only (counted, not logged again)"
            )

    def _keep_on_disk(self, digest: str, data: ChunkBytes) -> None:
        """The writer's job: the file under a temporary name, renamed into place, then counted."""
        try:
            self._write_file(digest, data)
        finally:
            with self._lock:
                if self._waiting.pop(digest, None) is not None:
                    self._waiting_bytes -= len(data)

    def _write_file(self, digest: str, data: ChunkBytes, pause: bool = True) -> None:
        """The chunk's file, written under a temporary name and renamed into place; standing aside
        between its pieces unless ``pause`` is False (another process waits for it)."""
        path = self._path(digest)
        tmp = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            stand_aside, view = self.stand_aside.pauses(self._closing), memoryview(data)
            with tmp.open("wb") as f:
                for offset in range(0, len(view), BACKGROUND_STEP):
                    if offset and pause:
                        f.flush()  # the piece is the kernel's before the pause
                        stand_aside()
                    f.write(view[offset : offset + BACKGROUND_STEP])
            os.replace(tmp, path)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if not self._disk_warned:  # a full disk would otherwise warn at every chunk
                self._disk_warned = True
                self._warn(f"cannot keep chunks in the local tier ({self.directory}): {exc.strerror or exc}")
            return
        self._count_on_disk(digest, len(data), verified=True)

    def _count_on_disk(self, digest: str, size: int, verified: bool) -> None:
        """A file in place counted as the disk level's most recently used, then the least recently
        used others (never a pinned one) dropped down to the budget."""
        with self._lock:
            if digest not in self._disk:
                self._disk[digest] = size
                self._disk_used += size
            self._disk.move_to_end(digest)
            if verified:
                self._verified.add(digest)
            victims = [d for d in self._disk if d != digest and not self._pins[d]]
        for victim in victims:
            if self._disk_used <= self.disk_bytes:
                break
            self._drop_file(victim)

    def _forget_disk(self, digest: str) -> None:
        with self._lock:
            size = self._disk.pop(digest, None)
            if size is not None:
                self._disk_used -= size
            self._verified.discard(digest)

    def _drop_file(self, digest: str) -> None:
        self._forget_disk(digest)
        try:
            self._path(digest).unlink(missing_ok=True)
        except OSError:
            pass

    def _scan(self) -> None:
        """The chunks an earlier run left, oldest use first (unchecked until read); then the budget.
        Temporary files of killed writers are removed first."""
        assert self.directory is not None
        self.temp_swept = sweep_temp_files(self.directory, time.time())
        sweep_claims(self.directory)
        found = []
        for sub in self.directory.glob("??"):
            for path in sub.iterdir() if sub.is_dir() else ():
                if HEX64.fullmatch(path.name) and path.name.startswith(sub.name):
                    try:
                        st = path.stat()
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, path.name, st.st_size))
        for _, digest, size in sorted(found):
            self._disk[digest] = size
            self._disk_used += size
        for victim in list(self._disk):
            if self._disk_used <= self.disk_bytes:
                break
            self._drop_file(victim)

    # -- figures -----------------------------------------------------------------------------------

    @property
    def memory_used(self) -> int:
        return self._memory_used

    @property
    def disk_used(self) -> int:
        return self._disk_used

    def unchecked(self, digest: str) -> bool:
        """Whether the chunk was fetched with ``check_later`` and not yet admitted."""
        return digest in self._unchecked

    def in_memory(self, digest: str) -> bool:
        return digest in self._memory

    def on_disk(self, digest: str) -> bool:
        return digest in self._disk
