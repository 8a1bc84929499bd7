"""Saving prompts into a chunk store off the forward path: a bounded queue and a process of its own.

Why a process and not a thread: the engine's forward step runs PyTorch ops that release Python's
lock (GIL) and must take it back after each op. A save thread running Python in between makes the
forward wait for it, op after op: measured, a save thread cost the forward 60% of its first-token
time on two idle cores, while the same saves in another process cost next to nothing.

So the engine's worker only hands a prompt's keys and values over: it gathers them out of vLLM's
blocks straight into an anonymous shared-memory file (``memfd``: it has no name, so nothing outlives
the two processes) and sends its descriptor with the prompt's ids over a socket to the save process
(``python -m kvcdn_vllm.saver``, started with the engine, one torch thread, a lower CPU priority).
Those files are kept and reused (:class:`Arena`): writing into memory already mapped costs the copy
alone, while fresh pages cost the kernel's page faults too, about three times the copy here. That process
writes the prompt as an artifact in a scratch directory (:mod:`kvcdn_vllm.writer`, the same file any
kvcdn tool reads, each tensor hashed once for its manifest) and puts it into the store with core's
:meth:`~kvcdn_core.store.chunkstore.ChunkStore.put`, which uploads only the chunks the store lacks.
That put skips its own check of the file against its manifest (``verified``): the process wrote the
file a moment ago, in its own scratch directory. The store is opened in the save process from its
URI (core's chunk store on a backend of bytes, or the hosted service's own:
:func:`~kvcdn_core.store.chunkstore.open_chunk_store`), with the engine's environment.

Back pressure: when ``capacity`` saves are in flight (being gathered or handed over, not answered
yet), a new one is skipped with one warning line: the forward never waits for the store. Shared
memory held: the prompts in flight, and at most :data:`IDLE_ARENAS` files kept for reuse, each
rounded up to a power of two.
A save that fails (store unreachable, refusing, over quota, disk full) fails no request: the first
failure of a run is one warning line, the saves that fail after it are only counted (a store that
is down does not flood the log), and the first save that works again says so in one line. A save
process that dies loses the saves it held (counted as failed, one line); the next save starts a new one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any

import torch

from kvcdn_core.store.chunkstore import PutReport
from kvcdn_vllm.writer import SavedModel, write_prompt_artifact

#: layer index → that layer's ``(keys, values)`` pieces in token order, each ``[kv_heads, tokens, head_size]``
Pieces = dict[int, list[tuple[torch.Tensor, torch.Tensor]]]

#: shared-memory files kept mapped for the next saves once their save is done
IDLE_ARENAS = 2


@dataclasses.dataclass(frozen=True)
class SaveTarget:
    """Where saves go and what their manifests say of the model: sent to the save process once."""

    store: str  # the store's URI, opened in the save process
    model: SavedModel
    #: the engine's block size: the rows of a prompt's last, partial block are recomputed by the
    #: next turn (vLLM caches full blocks only), not always to the same bits, so the store's put
    #: cuts its last chunk there (``settled``) and the next turn's save references the rows before
    block_size: int | None = None


@dataclasses.dataclass(frozen=True)
class _Job:
    """One prompt to save; its tensors follow as a shared-memory descriptor, each piece's keys and
    values at the byte offsets ``pieces`` gives, in token order within a layer."""

    seq: int
    name: str
    prompt_ids: list[int]
    dtype: str
    pieces: list[tuple[int, tuple[int, ...], int, int]]  # (layer, shape, keys offset, values offset)
    size: int


class Arena:
    """An anonymous shared-memory file, mapped in the engine's worker, reused from save to save."""

    def __init__(self, size: int):
        self.size = 1 << max(size - 1, 1 << 20).bit_length()  # a power of two: reused as prompts grow
        self.fd = os.memfd_create("kvcdn-save", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._memory = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.flat = torch.frombuffer(self._memory, dtype=torch.uint8)

    def close(self) -> None:
        del self.flat  # no view may outlive the mapping
        self._memory.close()
        os.close(self.fd)


class Handover:
    """One prompt's keys and values on their way to the save process: room for each piece, taken
    from its arena in the order the worker gathers them (layer by layer)."""

    def __init__(self, seq: int, name: str, arena: Arena):
        self.seq, self.name, self.arena = seq, name, arena
        self.pieces: list[tuple[int, tuple[int, ...], int, int]] = []
        self.dtype: torch.dtype | None = None
        self._used = 0

    def room(self, layer: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` views of the arena for one piece of ``layer``, each of ``shape``;
        pieces of a layer are taken in token order."""
        if self.dtype not in (None, dtype):
            raise ValueError(f"layers of two dtypes ({self.dtype}, {dtype})")
        n = math.prod(shape) * dtype.itemsize
        if self._used + 2 * n > self.arena.size:
            raise ValueError(f"the prompt's layers need more than the {self.arena.size} bytes set aside for them")
        offsets = (self._used, self._used + n)
        self._used += 2 * n
        self.dtype = dtype
        self.pieces.append((layer, tuple(shape), *offsets))
        keys, values = (self.arena.flat[o : o + n].view(dtype).view(shape) for o in offsets)
        return keys, values

    def copy(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One piece that is already in memory, copied in."""
        room_keys, room_values = self.room(layer, tuple(keys.shape), keys.dtype)
        room_keys.copy_(keys)
        room_values.copy_(values)

    def job(self, prompt_ids: list[int]) -> _Job:
        dtype = str(self.dtype).removeprefix("torch.")
        return _Job(self.seq, self.name, list(prompt_ids), dtype, list(self.pieces), self._used)


class SaveQueue:
    """Puts prompts into ``target.store`` from a process of its own, at most ``capacity`` in flight.

    Per prompt: :meth:`hand_over` sets shared memory aside (or skips the prompt when the queue is
    full), the worker writes the prompt's pieces into it, then :meth:`submit` sends it, or
    :meth:`drop` gives the memory back when the prompt is not saved after all.
    """

    def __init__(
        self,
        target: SaveTarget,
        capacity: int,
        warn: Callable[[str], None],
        done: Callable[[str, PutReport], None] | None = None,
        info: Callable[[str], None] | None = None,
        nice: int = 10,
    ):
        self.target = target
        self.capacity = capacity
        self._warn = warn
        self._done = done
        self._info = info
        self._nice = nice
        self._failing = 0  # saves failed since the last one that worked
        self._lock = threading.Condition()
        self._seq = itertools.count()
        self._flight: dict[int, Handover] = {}  # being gathered, or handed over and not answered
        self._idle: list[Arena] = []
        self._process: _SaveProcess | None = None
        self.saved = self.skipped = self.failed = 0
        self.bytes_moved = 0
        self._start()

    def _start(self) -> _SaveProcess:
        self._process = _SaveProcess(self.target, self._nice, self._answered, self._lost)
        return self._process

    def hand_over(self, name: str, size: int) -> Handover | None:
        """Shared memory for one prompt's ``size`` bytes of keys and values; None, and one warning
        line, when ``capacity`` saves are in flight already (the caller never waits)."""
        with self._lock:
            if len(self._flight) >= self.capacity:
                self.skipped += 1
                self._warn(f"not saving {name}: {self.capacity} saves are already waiting for the store")
                return None
            fitting = [a for a in self._idle if a.size >= size]
            arena = min(fitting, key=lambda a: a.size) if fitting else None
            if arena is not None:
                self._idle.remove(arena)
        if arena is None:
            try:
                arena = Arena(size)
            except OSError as exc:  # no shared memory to be had
                self._failed(name, f"no shared memory for its {size} bytes: {exc}")
                return None
        handover = Handover(next(self._seq), name, arena)
        with self._lock:
            self._flight[handover.seq] = handover
        return handover

    def submit(self, handover: Handover, prompt_ids: list[int]) -> None:
        """Send the prompt written into ``handover`` to the save process."""
        with self._lock:
            process = self._process if self._process is not None and self._process.alive() else self._start()
            process.held.add(handover.seq)
        process.send(handover.job(prompt_ids), handover.arena.fd)  # a process gone meanwhile: its reader counts it

    def save(self, name: str, prompt_ids: list[int], layers: Pieces) -> bool:
        """Hand over pieces that are already in memory (copied in once); False when skipped."""
        size = sum(k.nbytes + v.nbytes for pieces in layers.values() for k, v in pieces)
        handover = self.hand_over(name, size)
        if handover is None:
            return False
        for index, pieces in sorted(layers.items()):
            for keys, values in pieces:
                handover.copy(index, keys, values)
        self.submit(handover, prompt_ids)
        return True

    def drop(self, handover: Handover) -> None:
        """The prompt is not saved after all (one line said why): its memory goes back."""
        self._finish(handover.seq)

    def _finish(self, seq: int) -> Handover | None:
        with self._lock:
            handover = self._flight.pop(seq, None)
            if handover is not None:
                self._idle.append(handover.arena)
                self._idle.sort(key=lambda a: a.size)
                while len(self._idle) > IDLE_ARENAS:  # keep the largest for the next prompts
                    self._idle.pop(0).close()
            self._lock.notify_all()
        return handover

    def _answered(self, process: _SaveProcess, seq: int, outcome: str, detail: Any) -> None:
        process.held.discard(seq)
        handover = self._finish(seq)
        if handover is None:
            return
        if outcome == "saved":
            self._saved(handover.name, detail)
        else:
            self._failed(handover.name, str(detail))

    def _lost(self, process: _SaveProcess, code: int | None) -> None:
        """The save process ended while it held saves: each is failed, with one line for them all."""
        lost = [h for seq in sorted(process.held) if (h := self._finish(seq)) is not None]
        process.held.clear()
        if lost:
            self.failed += len(lost)
            self._failing += len(lost)
            self._warn(
                f"the save process stopped (exit code {code}); {len(lost)} saves it held were not saved; "
                "the next save starts a new process"
            )

    def _saved(self, name: str, report: PutReport) -> None:
        if self._failing and self._info is not None:
            self._info(f"saving to the store works again; {self._failing} saves failed meanwhile")
        self._failing = 0
        self.saved += 1
        self.bytes_moved += report.bytes_moved
        if self._done is not None:
            self._done(name, report)

    def _failed(self, name: str, detail: str) -> None:
        self.failed += 1
        self._failing += 1
        if self._failing == 1:
            self._warn(
                f"not saving {name}: {detail} (saves that fail after this one are counted, not logged, "
                "until one works again)"
            )

    def join(self) -> None:
        """Wait until every save handed over is answered (tests, and engine shutdown)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._flight)

    def close(self) -> None:
        """Finish what is in flight, then stop the save process and unmap the shared memory."""
        process, self._process = self._process, None
        if process is not None:
            process.close()
        self.join()
        with self._lock:
            idle, self._idle = self._idle, []
        for arena in idle:
            arena.close()


class _SaveProcess:
    """The save process and the engine's end of its socket; a thread reads its answers."""

    def __init__(
        self,
        target: SaveTarget,
        nice: int,
        answered: Callable[[_SaveProcess, int, str, Any], None],
        lost: Callable[[_SaveProcess, int | None], None],
    ):
        ours, theirs = socket.socketpair()
        self.held: set[int] = set()
        self._send_lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcdn_vllm.saver", str(theirs.fileno()), str(nice)],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self._answered, self._lost = answered, lost
        self.send_setup(target)
        self._reader = threading.Thread(target=self._read, name="kvcdn-save-answers", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def send_setup(self, target: SaveTarget) -> None:
        try:
            self.conn.send(target)
        except OSError:
            pass  # it died at once: the reader says so

    def send(self, job: _Job, fd: int) -> None:
        try:
            with self._send_lock:  # a job and its descriptor go together
                self.conn.send(job)
                send_handle(self.conn, fd, self.proc.pid)
        except OSError:
            pass  # the process is gone: its reader counts what it held

    def _read(self) -> None:
        while True:
            try:
                seq, outcome, detail = self.conn.recv()
            except (EOFError, OSError):
                break
            self._answered(self, seq, outcome, detail)
        self._lost(self, self.proc.wait())
        self.conn.close()

    def close(self) -> None:
        """Ask the process to finish its queue and stop; wait for its last answer."""
        try:
            with self._send_lock:
                self.conn.send(None)
        except OSError:
            pass
        self._reader.join()


def _layers(memory: mmap.mmap, job: _Job) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's whole prompt ``(keys, values)``: views of ``memory``, pieces joined in token order."""
    dtype = getattr(torch, job.dtype)
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    parts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for layer, shape, *offsets in job.pieces:
        n = math.prod(shape) * dtype.itemsize
        for role, offset in enumerate(offsets):
            parts.setdefault(layer, ([], []))[role].append(flat[offset : offset + n].view(dtype).view(shape))
    return {
        layer: (
            keys[0] if len(keys) == 1 else torch.cat(keys, 1),
            values[0] if len(values) == 1 else torch.cat(values, 1),
        )
        for layer, (keys, values) in sorted(parts.items())
    }


def _serve(conn: Connection) -> None:
    """The save process: set up once, then save each job as it comes; answer each one."""
    from kvcdn_core import open_storage
    from kvcdn_core.store.chunkstore import ChunkStore, open_chunk_store

    target: SaveTarget = conn.recv()
    store: Any = None
    while True:
        job: _Job | None = conn.recv()
        if job is None:
            return
        fd = recv_handle(conn)
        try:
            # a private mapping: writable views for torch, never written
            memory = mmap.mmap(fd, job.size, flags=mmap.MAP_PRIVATE)
        finally:
            os.close(fd)
        try:
            if store is None:
                store = open_chunk_store(open_storage(target.store))
            own: dict[str, Any] = {"verified": True} if isinstance(store, ChunkStore) else {}
            if target.block_size:  # both stores' puts take it (core's, and the hosted one's)
                own["settled"] = len(job.prompt_ids) // target.block_size * target.block_size
            with tempfile.TemporaryDirectory(prefix="kvcdn-save-") as scratch:
                path = write_prompt_artifact(Path(scratch), target.model, job.prompt_ids, _layers(memory, job))
                report = store.put(path, job.name, force=True, **own)
            answer: tuple[int, str, Any] = (job.seq, "saved", report)
        except Exception as exc:  # a store that fails must not stop the saves: the engine says it in one line
            answer = (job.seq, "failed", str(exc).splitlines()[0] if str(exc) else repr(exc))
        del memory  # unmapped before the answer: the engine reuses the arena once answered
        conn.send(answer)


def main(argv: list[str]) -> None:
    """``python -m kvcdn_vllm.saver FD NICE``: the save process, on the socket ``FD``."""
    os.nice(int(argv[1]))
    # vLLM's CPU worker binds its threads to cores, and a child starts with its parent's binding:
    # left so, the save process would take turns with the forward on the forward's own core
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cgroup that allows fewer cores keeps the binding it gave
        pass
    torch.set_num_threads(1)
    conn = Connection(int(argv[0]))
    try:
        _serve(conn)
    except (EOFError, OSError):  # the engine is gone
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
