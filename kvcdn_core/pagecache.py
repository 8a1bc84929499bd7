"""The page cache, seen from one file: how much of it is resident, and how to evict it.

The loader asks :func:`resident_fraction` to choose between a buffered read (the file is in memory
already) and a direct read that bypasses the page cache (it is not: the disk's DMA fills the
destination and no CPU copies the bytes). The benchmark evicts files with :func:`evict` so that
timed loads are cold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path


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
