"""Atomic file writes: a temporary file in the target's directory, fsync, rename, fsync the directory.

Artifacts, downloads, credentials, indexes and reports all go through here, so an error or a crash
never leaves a half-written file under the target name, and a failed write leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, mode: int | None = None, suffix: str = ".tmp"):
    """Yield a temporary path next to ``target``; on success it replaces ``target``.

    ``mode`` sets the final permissions (the temporary file is 0600 while it is written, so a
    secret is never readable by others); by default the file follows the umask like any other.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_open(target: str | os.PathLike, text: bool = False, mode: int | None = None):
    """Like ``open(target, "w"/"wb")``, but the file appears only complete, or not at all."""
    with atomic_path(target, mode) as tmp:
        with open(tmp, "w" if text else "wb", encoding="utf-8" if text else None) as fh:
            yield fh


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_stream(target: Path, stream: IO[bytes], chunk: int = 1 << 20) -> int:
    """Copy a binary stream to ``target`` through a temp file in the same directory; return bytes."""
    with atomic_open(target) as out:
        shutil.copyfileobj(stream, out, chunk)
        written = out.tell()
    return written


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON (indented, UTF-8, trailing newline) atomically."""
    with atomic_open(path, text=True) as fh:
        json.dump(data, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
