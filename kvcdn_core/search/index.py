"""The search index: artifacts found under a directory, read once and kept per directory.

Searching reads only artifact headers and token ids (pure Python plus numpy, never torch), keeps
them in one index file per directory so a later search reads one file per directory instead of
every artifact. A search reads an index file's table (names, identities, models) and leaves its
token ids on disk: an entry reads its own, by offset, the first time they are asked for, so a
search through the prefix index reads the ids of its few candidates only.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import threading
from collections import OrderedDict
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
INDEX_VERSION = 2

Warn = Callable[[str], None]

_COLUMNS = ("names", "size", "mtime_ns", "ino", "token_count", "model", "reuse", "compute_dtype", "quantization")


# -- the catalog: artifacts found under a directory -------------------------------------------


_OPEN_MAX = 64  # index files kept open for their entries' ids: a tree of many directories stays in the fd limit
_open: OrderedDict[_IdsFile, None] = OrderedDict()  # least recently read first
_open_lock = threading.Lock()  # a descriptor is closed only while no read uses it


class _IdsFile:
    """A directory index as a scan read it, for its entries to read their token ids from by offset.

    Its descriptor is kept (up to ``_OPEN_MAX`` files, least recently read closed first), so an
    index another search renames over it meanwhile does not matter; one closed is reopened only if
    it is still the same file (device, inode, size, mtime), else the read gives None. ``digest`` (of
    its table) and ``rows`` (each entry's ``_source``) let :func:`identity` take a directory read
    whole as one digest."""

    def __init__(self, path: Path, st: os.stat_result, fd: int, start: int, digest: bytes):
        self.path, self.start, self.digest = path, start, digest
        self.ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.rows: list[tuple[_IdsFile, int]] = []
        self.fd: int | None = None
        with _open_lock:
            self._keep(fd)

    def _keep(self, fd: int) -> None:
        self.fd = fd
        _open[self] = None
        while len(_open) > _OPEN_MAX:
            old, _ = _open.popitem(last=False)
            if old.fd is not None:
                os.close(old.fd)
            old.fd = None

    def read(self, offset: int, count: int) -> np.ndarray | None:
        """``count`` int32 ids from ``offset``; None when the file is not the one the scan read or
        was cut short behind kvcdn's back."""
        with _open_lock:
            if self.fd is None:
                try:
                    fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    return None
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self.ident:
                    os.close(fd)
                    return None
                self._keep(fd)
            else:
                _open.move_to_end(self)
            assert self.fd is not None
            data = os.pread(self.fd, 4 * count, self.start + 4 * offset)
        return np.frombuffer(data, dtype="<i4") if len(data) == 4 * count else None


class Entry:
    """What search needs of one artifact: where it is, its model, its reuse rule and its token ids.

    An entry read from a directory index builds its ``path`` and reads its ``ids`` on first use:
    a search touches every entry, but asks the path and ids of its candidates only.
    """

    __slots__ = (
        "_path",
        "_where",
        "size",
        "mtime_ns",
        "ino",
        "model",
        "token_count",
        "reuse",
        "compute_dtype",
        "quantization",
        "_ids",
        "_source",
    )

    def __init__(
        self,
        path: Path | None,
        size: int,
        mtime_ns: int,
        ino: int,
        model: dict[str, Any],
        token_count: int,
        reuse: str,
        compute_dtype: str,
        quantization: str | None,
        ids: np.ndarray | None,  # int32, length token_count
        *,
        where: tuple[Path, str, str] | None = None,  # (directory, its path with a separator, name)
        source: tuple[_IdsFile, int] | None = None,  # (index file, offset of the ids)
    ):
        self._path, self._where = path, where
        self.size, self.mtime_ns, self.ino = size, mtime_ns, ino
        self.model, self.token_count, self.reuse = model, token_count, reuse
        self.compute_dtype, self.quantization = compute_dtype, quantization
        self._ids, self._source = ids, source

    @property
    def path(self) -> Path:
        if self._path is None:
            assert self._where is not None
            self._path = self._where[0] / self._where[2]
        return self._path

    @path.setter
    def path(self, value: Path) -> None:
        self._ids = self.ids  # moved: no longer the entry its directory index describes
        self._path, self._where, self._source = value, None, None

    @property
    def name(self) -> str:
        return self._where[2] if self._where is not None else self.path.name

    @property
    def location(self) -> str:
        """``str(self.path)``, without building the path."""
        return self._where[1] + self._where[2] if self._where is not None else str(self.path)

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._ids = self._read_ids()
        return self._ids

    @ids.setter
    def ids(self, value: np.ndarray) -> None:
        self._ids, self._source = value, None

    def _read_ids(self) -> np.ndarray:
        ids = None
        if self._source is not None:
            ids = self._source[0].read(self._source[1], self.token_count)
        if ids is None:  # the index file was cut short behind kvcdn's back: the artifact itself
            ids = np.asarray(artifact.read_token_ids(self.path), dtype=np.int32)
            if ids.size != self.token_count:
                raise ArtifactError(f"{self.path}: changed during the search; search again")
        return ids

    def __repr__(self) -> str:
        return f"Entry({self.location!r}, {self.token_count} tokens, {self.reuse})"

    def __reduce__(self):
        """Pickled and copied whole: an open index file means nothing in another process."""
        fields = (self.size, self.mtime_ns, self.ino, self.model, self.token_count, self.reuse)
        return Entry, (self.path, *fields, self.compute_dtype, self.quantization, self.ids)


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
    """Entries of an index file, by file name, their ids left in the file; empty when missing,
    foreign-owned, of another version or malformed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return {}
    ids_file = None
    try:
        st = os.fstat(fd)
        # An index written by another user could point search at the wrong artifacts.
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            return {}
        head = os.pread(fd, 16, 0)
        if len(head) != 16 or head[:8] != INDEX_MAGIC:
            return {}
        (json_len,) = struct.unpack_from("<Q", head, 8)
        if 16 + json_len > st.st_size:
            return {}
        table = os.pread(fd, json_len, 16)
        meta = json.loads(table)
        if not isinstance(meta, dict) or meta.get("version") != INDEX_VERSION:
            return {}
        start = 16 + json_len
        start += (-start) % 4
        cols = [meta[k] for k in _COLUMNS]
        models = [dict(m) for m in meta["models"]]
        names, counts = cols[0], cols[4]
        if not all(isinstance(c, list) and len(c) == len(names) for c in cols):
            return {}
        if not all(isinstance(c, int) and c >= 0 for c in counts) or start + 4 * sum(counts) > st.st_size:
            return {}
        if not all(isinstance(m, int) and 0 <= m < len(models) for m in cols[5]):
            return {}
        ids_file = _IdsFile(path, st, fd, start, hashlib.sha256(table).digest())
        where_dir = "" if str(directory) == "." else os.path.join(str(directory), "")
        entries, offset = {}, 0
        for name, size, mtime_ns, ino, count, model, reuse, dtype, quant in zip(*cols):
            row = (ids_file, offset)
            ids_file.rows.append(row)
            if not isinstance(name, str) or "/" in name or os.sep in name or name in (".", ".."):
                return {}
            entries[name] = Entry(
                None,
                int(size),
                int(mtime_ns),
                int(ino),
                models[model],  # shared by the entries of one model: search compares each model once
                count,
                str(reuse),
                str(dtype),
                quant if isinstance(quant, str) else None,
                None,
                where=(directory, where_dir, name),
                source=row,
            )
            offset += count
        return entries
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return {}
    finally:
        if ids_file is None:
            os.close(fd)


def identity(entries: list[Entry], base: str) -> bytes:
    """A digest of what ``entries`` are: each one's path (relative to ``base``, a directory path
    ending in a separator), size, mtime, inode, model, token count and reuse rule, the identity the
    directory indexes check. The entries of a directory index read whole, in order, count as that
    index's table digest: it holds all of that, so an unchanged directory costs no work per artifact."""
    parts: list[Any] = []
    i = 0
    while i < len(entries):
        e = entries[i]
        rel = e.location
        rel = rel[len(base) :] if rel.startswith(base) else rel
        src = e._source
        if src is not None and src[1] == 0:
            rows = src[0].rows
            if [x._source for x in entries[i : i + len(rows)]] == rows:
                parts.append((os.path.dirname(rel), src[0].digest))
                i += len(rows)
                continue
        model = json.dumps(e.model, sort_keys=True)
        parts.append((rel, e.size, e.mtime_ns, e.ino, model, e.token_count, e.reuse))
        i += 1
    return hashlib.sha256(repr(parts).encode(errors="surrogateescape")).digest()


def _write_index(path: Path, entries: list[Entry]) -> None:
    """Write an index atomically (temporary file, fsync, rename); a failure only costs speed.

    A table of columns (one list per field, each model once) and then every entry's ids, in order."""
    models: dict[str, int] = {}
    for e in entries:
        models.setdefault(json.dumps(e.model, sort_keys=True), len(models))
    meta: dict[str, Any] = {"version": INDEX_VERSION, "models": [json.loads(m) for m in models]}
    meta["names"] = [e.name for e in entries]
    for key in ("size", "mtime_ns", "ino", "token_count", "reuse", "compute_dtype", "quantization"):
        meta[key] = [getattr(e, key) for e in entries]
    meta["model"] = [models[json.dumps(e.model, sort_keys=True)] for e in entries]
    blob = json.dumps(meta, separators=(",", ":")).encode()
    head = INDEX_MAGIC + struct.pack("<Q", len(blob)) + blob
    head += b"\0" * ((-len(head)) % 4)
    try:
        with atomic_open(path, mode=0o600) as fh:
            fh.write(head)
            for e in entries:
                fh.write(np.ascontiguousarray(e.ids, dtype="<i4").tobytes())
    except OSError:
        pass


def _regular_files(directory: Path, names: list[str], warn: Warn) -> list[tuple[str, os.stat_result]]:
    """Each name's stat, regular files only; stat'ed relative to the directory (no path to build
    and resolve per file)."""
    try:
        dir_fd: int | None = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        dir_fd = None
    found = []
    try:
        for name in names:
            try:
                st = os.stat(name, dir_fd=dir_fd) if dir_fd is not None else os.stat(os.path.join(directory, name))
            except OSError as exc:
                warn(f"skipping {os.path.join(directory, name)}: cannot read: {exc.strerror or exc}")
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((name, st))
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return found


def _index_directory(directory: Path, names: list[str], warn: Warn) -> list[Entry]:
    where = index_path(directory)
    known = _read_index(where, directory)
    entries, changed = [], False
    for name, st in _regular_files(directory, names, warn):
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
    if changed or {e.name for e in entries} != set(known):
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
