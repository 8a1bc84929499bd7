"""How many cores this process may use, and how a load shares them with torch's threads.

CPU timings swing when more threads want to run than there are cores: each parallel region of
torch waits for its slowest thread, and a preempted thread makes it wait a scheduler tick. So
torch gets the physical cores (the default of ``kvcdn benchmark --threads``), a whole load (nothing
else runs) hashes on every core, and a load is streamed under the model's forward
(:mod:`kvcdn_core.artifact.layer_stream`) only where torch leaves a core free for its workers. A cold file
is read with ``O_DIRECT`` (:mod:`kvcdn_core.artifact.tensor_io`), so the disk's wait costs no core, but
filling fresh memory still costs the kernel's time.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: More hashing threads than this gain nothing: 4 threads hash faster than the disks we read from.
MAX_HASH_WORKERS = 4


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """Cores this process may run on, counting SMT siblings once."""
    cores = set()
    for cpu in allowed_cpus():
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        cores.add(siblings)
    return max(1, len(cores))


def hash_workers() -> int:
    """Hashing threads of a whole load, which runs alone: every allowed CPU, up to the cap."""
    return max(1, min(MAX_HASH_WORKERS, len(allowed_cpus())))


def stream_workers(torch_threads: int) -> int:
    """Workers of a load streamed under a forward that runs ``torch_threads`` threads: the physical
    cores torch leaves free, up to the cap; 0 when torch has them all (then nothing is streamed)."""
    return max(0, min(MAX_HASH_WORKERS, physical_cores() - torch_threads))


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` threads named ``kvcdn-<name>``, started on first use.

    A small artifact loads in milliseconds, and starting its reader and hashing threads anew for
    every load cost about as much again (5-7 ms a load on this project's 2-core machine). The pool's
    size is fixed by its first caller; a forked child starts its own (the parent's threads do not
    run there).
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"kvcdn-{name}")
        return pool


def _forget_pools_in_child() -> None:
    global _POOLS_LOCK
    _POOLS_LOCK = threading.Lock()
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)
