"""The page cache, seen from one file: how much of it is resident, and how to make it cold.

The loader asks :func:`resident_fraction` to choose between a buffered read (the file is in memory
already) and a direct read that bypasses the page cache (it is not: the disk's DMA fills the
destination and no CPU copies the bytes). The benchmark makes files cold with :class:`PageCache`
(:func:`evict` on the file, or the whole host's cache dropped) so that timed loads are what a fresh
process pays, and checks every drop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

from kvcdn_core.errors import KvcdnError

#: A file counts as cold when at most this fraction of its pages is resident after a drop.
COLD_RESIDENCY = 0.05


def resident_fraction(path: str | os.PathLike) -> float | None:
    """The fraction of ``path``'s pages in the page cache (Linux ``mincore``), or None if unknown."""
    if not sys.platform.startswith("linux"):
        return None
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = _libc()
    if libc is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return (pages - bytes(vec).count(0)) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def evict(path: Path) -> bool:
    """Drop one file's clean pages from the page cache (``posix_fadvise(DONTNEED)`` after a sync)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class PageCache:
    """Makes a file cold before a timed read: ``/proc/sys/vm/drop_caches`` where the process may
    write it, else ``posix_fadvise(DONTNEED)`` on the file; ``mode='keep'`` leaves it warm.

    Every drop is checked with ``mincore``, so the output can say how cold the reads really were.
    """

    def __init__(self, mode: str = "file"):
        if mode not in ("auto", "system", "file", "keep"):
            raise KvcdnError(f"unknown page-cache mode '{mode}' (auto, system, file, keep)")
        self.mode = mode
        self.method: str | None = None
        self.max_resident: float | None = None

    def drop(self, path: Path) -> None:
        if self.mode == "keep":
            self.method = "none"
            return
        if self.mode in ("auto", "system") and self.method in (None, "drop_caches"):
            if _drop_system_caches():
                self.method = "drop_caches"
            elif self.mode == "system":
                raise KvcdnError("cannot write /proc/sys/vm/drop_caches (needs root on Linux); use --page-cache file")
        if self.method != "drop_caches":
            self.method = "fadvise" if evict(path) else "none"
        resident = resident_fraction(path)
        if resident is not None:
            self.max_resident = max(self.max_resident or 0.0, resident)

    def describe(self) -> str:
        if self.method in (None, "none"):
            return "warm: the page cache was not dropped, loads may read from memory"
        how = (
            "/proc/sys/vm/drop_caches (sync, then 1)"
            if self.method == "drop_caches"
            else "posix_fadvise(DONTNEED) on the artifact"
        )
        if self.max_resident is None:
            return f"dropped before each load with {how} (residency not checkable here)"
        if self.max_resident > COLD_RESIDENCY:
            return (
                f"NOT cold: after {how} up to {self.max_resident:.0%} of the file stayed "
                "in the page cache (a tmpfs or a file system that ignores the drop)"
            )
        return f"dropped before each load with {how}; at most {self.max_resident:.0%} of the file stayed resident"


def _drop_system_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        except (OSError, AttributeError):
            libc = None
        _LIBC.append(libc)
    return _LIBC[0]
