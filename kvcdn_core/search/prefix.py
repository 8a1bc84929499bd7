"""The prefix index of a directory search: which artifacts can match a query, without comparing every one.

A match must share more than the tokenizer's start tokens with the query (:func:`rank`), and those
tokens lie in the first chunk of 256. So the index is the chunk store's trie
(:mod:`kvcdn_core.store.index`, one root per model) over each any-prefix artifact's first chunk:
the children of a root sharing the query's first ``start + 1`` tokens form one sorted range, and
the artifacts below it are exactly those that can match. Their exact prefix is then measured on
their own token ids (held by the directory indexes), and :func:`rank` orders them, so the result
is the linear ranking's, row for row, partial matches included. Whole-prefix artifacts (few, not
in a store trie's edges) are always compared. A tokenizer with more start tokens than a chunk
falls back to the linear ranking.

The trie is kept in one file per searched directory (``.kvcdn-prefix``, or a per-user cache file
for a read-only one), with a BLAKE3 digest of its bytes and a digest of what it was made from
(:func:`~kvcdn_core.search.index.identity`: each artifact's relative path, size, mtime, inode,
model and token count, a directory index read whole counting as its table's digest). A search
whose scan gives another identity updates the trie from what changed (removed ones
dropped, new ones hashed, the rest taken from the old trie) and rewrites the file atomically. A
damaged, foreign or other-user-owned file is ignored and rebuilt: it is a cache, never the truth.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import blake3
import numpy as np

from kvcdn_core.artifact.manifest import ANY_PREFIX
from kvcdn_core.atomic import atomic_open
from kvcdn_core.model.files import COMPATIBILITY_KEYS
from kvcdn_core.search.index import Entry, cache_home, identity, index_path
from kvcdn_core.search.rank import Ranking, rank, same_model
from kvcdn_core.store import index as trie_index
from kvcdn_core.store.keys import CHUNK_TOKENS

PREFIX_NAME = ".kvcdn-prefix"
MAGIC = b"KVCDNPX1"
_MODEL_KEYS = (*COMPATIBILITY_KEYS, "weights_sha256")  # what fingerprint_differences compares


def _group_key(model: dict) -> tuple:
    """What :func:`same_model` compares: artifacts equal in it rank alike (the model id plays no part)."""
    return tuple(map(model.get, _MODEL_KEYS))


def _root(group: tuple) -> str:
    return hashlib.sha256(repr(group).encode(errors="surrogateescape")).hexdigest()


def _art_id(rel: str, e: Entry) -> str:
    ident = f"{rel}\0{e.size}\0{e.mtime_ns}\0{e.ino}\0{e.token_count}"
    return hashlib.sha256(ident.encode(errors="surrogateescape")).hexdigest()[:32]


@dataclasses.dataclass
class PrefixIndex:
    """The artifacts of one search, grouped by model, and the trie over their first chunks."""

    entries: list[Entry]
    trie: trie_index._Trie
    by_name: dict[str, Entry]  # relative path -> entry
    groups: dict[str, tuple[dict, int, list[Entry]]]  # root -> (model, artifacts, whole-prefix ones)
    rebuilt: int  # artifacts hashed into the trie by this open (0: the file was current)

    def rank(self, fingerprint: dict, query_ids, start_tokens: int = 0) -> Ranking:
        """Exactly ``rank(entries, ...)``: the same rows in the same order, and the same counts."""
        if start_tokens + 1 > self.trie.chunk_tokens:
            return rank(self.entries, fingerprint, query_ids, start_tokens)
        q = np.asarray(query_ids, dtype=np.int64)
        candidates, n_same = [], 0
        for root, (model, count, whole) in self.groups.items():
            if not same_model(model, fingerprint):
                continue
            n_same += count
            arts = self.trie.arts
            candidates += [self.by_name[arts[r].name] for r in self.trie.sharing(root, q, start_tokens + 1)]
            candidates += whole
        found = rank(candidates, fingerprint, q, start_tokens)
        return Ranking(found.matches, n_same, len(self.entries) - n_same)


def open_index(directory: str | os.PathLike, entries: list[Entry]) -> PrefixIndex:
    """The prefix index of ``entries`` (a :func:`~kvcdn_core.search.index.scan` of ``directory``):
    the kept file when it was made from exactly these artifacts, else updated from it and rewritten."""
    directory = Path(directory)
    groups: dict[str, tuple[dict, int, list[Entry]]] = {}
    roots: dict[tuple, str] = {}
    indexed: list[tuple[str, str, Entry]] = []  # (relative path, root, entry)
    base = os.path.join(str(directory), "")
    by_model: dict[int, str] = {}  # id of a model dict -> its root: the entries of a directory index share one
    for e in entries:
        root = by_model.get(id(e.model))
        if root is None:
            group = _group_key(e.model)
            root = by_model[id(e.model)] = roots.get(group) or roots.setdefault(group, _root(group))
        model, count, whole = groups.get(root) or (e.model, 0, [])
        groups[root] = (model, count + 1, whole)
        if e.reuse != ANY_PREFIX:
            whole.append(e)
        elif e.token_count:
            path = e.location  # scan's paths are the directory's own, then names
            rel = path[len(base) :] if path.startswith(base) else os.path.relpath(path, directory)
            indexed.append((rel, root, e))
    by_name = {rel: e for rel, _, e in indexed}
    view = identity(entries, base)  # what the kept file must have been made from
    where = index_path(directory, PREFIX_NAME, cache_home() / "search-prefix")
    old, old_view = _read(where)
    if old is not None and old_view == view:
        return PrefixIndex(entries, old, by_name, groups, 0)
    state = trie_index._State(chunk_tokens=CHUNK_TOKENS)
    for root, (model, _, _) in groups.items():
        state.roots[root] = {"root": root, "model": model}
    reused = _edges(old) if old is not None else {}
    hashed = 0
    for rel, root, e in indexed:
        art_id = _art_id(rel, e)
        edges = reused.get(art_id)
        if edges is not None and edges[0] == root:
            art = trie_index._Art(art_id, rel, root, int(edges[2].size), ANY_PREFIX, 0, [(edges[1], edges[2])])
        else:
            head = np.asarray(e.ids[:CHUNK_TOKENS], dtype=np.int64)
            art = trie_index._art_from_ids(art_id, rel, root, ANY_PREFIX, 0, head, CHUNK_TOKENS)
            hashed += 1
        state.arts[art_id] = art
    trie = trie_index._Trie(state)
    if trie.arts:
        _write(where, view, trie.to_base(()))
    return PrefixIndex(entries, trie, by_name, groups, hashed)


def _edges(trie: trie_index._Trie) -> dict[str, tuple[str, bytes, np.ndarray]]:
    """Each artifact's (root, chunk key, tokens) in a kept trie: its one edge, from the root."""
    out = {}
    for i, art in enumerate(trie.arts):
        node = int(trie.art_node[i])
        if node >= trie.n_roots and int(trie.parent[node - trie.n_roots]) == trie.root_index.get(art.root):
            out[art.id] = (art.root, trie_index._kb(trie.node_key[node]), trie.edge_tokens(node).astype(np.int64))
    return out


def _read(path: Path) -> tuple[trie_index._Trie | None, bytes]:
    """The kept trie and the identity digest it was made for; None when missing, foreign-owned,
    damaged or of another chunk size."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                return None, b""
            data = fh.read()
    except OSError:
        return None, b""
    if data[:8] != MAGIC or blake3.blake3(data[40:]).digest() != data[8:40]:
        return None, b""
    try:
        meta, arrays = trie_index._unpack(str(path), trie_index.BASE_MAGIC, data[72:])
        trie = trie_index._Trie.from_base(str(path), meta, arrays)
    except trie_index.IndexCorrupt:
        return None, b""
    if trie.chunk_tokens != CHUNK_TOKENS or any(len(a.id) != 32 for a in trie.arts):
        return None, b""
    return trie, data[40:72]


def _write(path: Path, view: bytes, base: bytes) -> None:
    """Write the trie atomically with its digest; a failure only costs speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, mode=0o600) as fh:
            fh.write(MAGIC + blake3.blake3(view + base).digest() + view + base)
    except OSError:
        pass
