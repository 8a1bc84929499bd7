"""The search index: artifacts found under a directory, read once and kept per directory.

Searching reads only artifact headers and token ids (pure Python plus numpy, never torch), keeps
them in one index file per directory so a later search reads one file per directory instead of
every artifact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvcdn_core import artifact, notices
from kvcdn_core.artifact.manifest import manifest_of
from kvcdn_core.atomic import atomic_open
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.model.files import COMPATIBILITY_KEYS

INDEX_NAME = ".kvcdn-index"
INDEX_MAGIC = b"KVCDNIX1"
INDEX_VERSION = 1

Warn = Callable[[str], None]


# -- the catalog: artifacts found under a directory -------------------------------------------


@dataclasses.dataclass
class Entry:
    """What search needs of one artifact: where it is, its model, its reuse rule and its token ids."""

    path: Path
    size: int
    mtime_ns: int
    ino: int
    model: dict[str, Any]
    token_count: int
    reuse: str
    compute_dtype: str
    quantization: str | None
    ids: np.ndarray  # int32, length token_count

    def record(self) -> dict[str, Any]:
        return {
            "name": self.path.name,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ino": self.ino,
            "model": self.model,
            "token_count": self.token_count,
            "reuse": self.reuse,
            "compute_dtype": self.compute_dtype,
            "quantization": self.quantization,
        }


def _entry_from_file(path: Path, st: os.stat_result) -> Entry:
    header = artifact.read_header(path)
    ids = artifact.read_token_ids(path, header)
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ArtifactError(f"{path}: corrupted: token ids out of range")
    m = manifest_of(header)
    return Entry(
        path,
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
        {k: getattr(m.model, k) for k in ("id", *COMPATIBILITY_KEYS)},
        m.token_count,
        m.reuse,
        m.compute_dtype,
        m.scheme,
        array.astype(np.int32),
    )


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/kvcdn`` or ``~/.cache/kvcdn``: where indexes of read-only directories go."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kvcdn"


def index_path(directory: Path, name: str = INDEX_NAME, cache: Path | None = None) -> Path:
    """The directory's own ``.kvcdn-index`` (or ``name``), or a per-user cache file (in ``cache``)
    when the directory is read-only."""
    if os.access(directory, os.W_OK | os.X_OK):
        return directory / name
    key = hashlib.sha256(os.fsencode(directory.resolve())).hexdigest()[:32]
    return (cache or cache_home() / "search-index") / key


def _read_index(path: Path, directory: Path) -> dict[str, Entry]:
    """Entries of an index file, by file name; empty when missing, foreign-owned or malformed."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            # An index written by another user could point search at the wrong artifacts.
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                return {}
            data = fh.read()
    except OSError:
        return {}
    try:
        if data[:8] != INDEX_MAGIC:
            return {}
        (json_len,) = struct.unpack_from("<Q", data, 8)
        meta = json.loads(data[16 : 16 + json_len])
        if meta.get("version") != INDEX_VERSION:
            return {}
        start = 16 + json_len
        start += (-start) % 4
        ids = np.frombuffer(data, dtype="<i4", offset=start)
        entries = {}
        for rec in meta["entries"]:
            name, offset, count = rec["name"], int(rec["offset"]), int(rec["token_count"])
            if "/" in name or os.sep in name or name in (".", "..") or offset < 0 or offset + count > ids.size:
                return {}
            entries[name] = Entry(
                directory / name,
                int(rec["size"]),
                int(rec["mtime_ns"]),
                int(rec["ino"]),
                dict(rec["model"]),
                count,
                str(rec["reuse"]),
                str(rec["compute_dtype"]),
                rec.get("quantization"),
                ids[offset : offset + count],
            )
        return entries
    except (ValueError, KeyError, TypeError, struct.error):
        return {}


def _write_index(path: Path, entries: list[Entry]) -> None:
    """Write an index atomically (temporary file, fsync, rename); a failure only costs speed."""
    records, offset = [], 0
    for e in entries:
        records.append({**e.record(), "offset": offset})
        offset += e.token_count
    blob = json.dumps({"version": INDEX_VERSION, "entries": records}, separators=(",", ":")).encode()
    head = INDEX_MAGIC + struct.pack("<Q", len(blob)) + blob
    head += b"\0" * ((-len(head)) % 4)
    try:
        with atomic_open(path, mode=0o600) as fh:
            fh.write(head)
            for e in entries:
                fh.write(np.ascontiguousarray(e.ids, dtype="<i4").tobytes())
    except OSError:
        pass


def _index_directory(directory: Path, names: list[str], warn: Warn) -> list[Entry]:
    where = index_path(directory)
    known = _read_index(where, directory)
    entries, changed = [], False
    for name in names:
        path_str = os.path.join(directory, name)  # a Path only for new entries: building one costs more than the stat
        try:
            st = os.stat(path_str)
        except OSError as exc:
            warn(f"skipping {path_str}: cannot read: {exc.strerror or exc}")
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        old = known.get(name)
        if old and (old.size, old.mtime_ns, old.ino) == (st.st_size, st.st_mtime_ns, st.st_ino):
            entries.append(old)
            continue
        changed = True
        path = directory / name
        try:
            entries.append(_entry_from_file(path, st))
        except ArtifactError as exc:
            warn(f"skipping {exc}")
        except OSError as exc:
            warn(f"skipping {path}: cannot read: {exc.strerror or exc}")
    if changed or {e.path.name for e in entries} != set(known):
        _write_index(where, entries)
    return entries


def scan(root: str | os.PathLike, warn: Warn = notices.warn) -> list[Entry]:
    """Every readable `.kv` artifact under ``root`` (recursively), through the per-directory indexes.

    Unreadable or invalid files are skipped with one warning each; they are not cached, so they are
    tried again (and warned about again) next time.
    """
    root = Path(root)
    if not root.is_dir():
        raise KvcdnError(f"directory '{root}' does not exist" if not root.exists() else f"'{root}' is not a directory")

    def on_error(exc: OSError) -> None:
        warn(f"skipping {exc.filename}: cannot read: {exc.strerror or exc}")

    entries = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=on_error):
        dirnames.sort()
        names = sorted(f for f in filenames if f.endswith(".kv"))
        if names:
            entries.extend(_index_directory(Path(dirpath), names, warn))
    return entries
