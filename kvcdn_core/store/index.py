"""The prefix index of a chunk store: which artifacts share the longest token prefix with a query.

It is a trie over chain keys (:mod:`kvcdn_core.store.keys`): a node is a prefix of whole chunks
(the root, or the chain key of its last chunk), an edge is one chunk (256 tokens, or fewer for an
artifact's last, partial chunk) and carries its token ids once, however many artifacts share it.
A lookup hashes the query's full chunks and probes their keys (a sorted key table, binary search):
the deepest key present is the node where the query leaves the trie. Inside the next chunk the
node's children are kept sorted by their token ids, so a binary search finds the child sharing
the most tokens with the query: the match is exact to the token, and the cost depends on the
query's chunk count and the matched node's fan-out (logarithmically), never on the store's size.
Each node also knows the best artifact below it (fewest tokens, then name), so the best match and
the next ones come out of a small heap walk.

Whole-prefix artifacts (sliding-window, linear-attention or recurrent layers: their state is a
snapshot of the whole prefix) add no edges: they are kept at the node of their last whole chunk
with the remaining tokens, and a query finds them only when it contains them whole.

Layout in the store (any :class:`~kvcdn_core.contracts.storage.StorageBackend`), write-once objects
only, so concurrent writers on a plain object store never lose an update:

- ``index/ops/<id>.add``: one artifact added (its name, root, reuse rule and token ids);
- ``index/ops/<id>.del``: the add operations a remove cancelled;
- ``index/base/<time>-<id>.kvix``: a compacted snapshot (the trie above, and every cancelled id);
- ``index/changed``: a random mark each writer rewrites after its object is written. A reader whose
  cached index was listed under the mark it reads now has nothing new to list: a lookup costs one
  small read, not a listing of up to 256 objects (two of S3's requests, or a directory walk).

The index is the union of every object's operations, minus the cancelled adds. Compaction writes
a new base holding the union of what it read, then deletes what it read: an operation is deleted
only after it is durable in a newer object, and cancelled ids are kept, so no add is lost and no
removed artifact comes back, whatever runs concurrently. Pure Python and numpy: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import json
import re
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from kvcdn_core.artifact.manifest import ANY_PREFIX, WHOLE_PREFIX
from kvcdn_core.cores import shared_pool
from kvcdn_core.errors import KvcdnError
from kvcdn_core.store import keys as chainkeys

PREFIX = "index/"
OPS = "index/ops/"
BASES = "index/base/"
#: Rewritten with a new random value by every writer, after its index object is written.
MARK = "index/changed"
#: Seconds after which a reader lists the index even when the mark is the same: a writer whose
#: mark failed after its object (it raised), or a kvcdn from before the mark, is seen by then.
RELIST_S = 10.0
OP_MAGIC = b"KVCDNIO1"
BASE_MAGIC = b"KVCDNIB1"
VERSION = 1
#: Operation objects an add leaves before it compacts them into a new base.
COMPACT_AFTER = 256
#: Bytes of a chain key kept in the index: 128 bits, no collision in any plausible store.
KEY_BYTES = 16
_REUSE = (ANY_PREFIX, WHOLE_PREFIX)
_HEX = re.compile(r"[0-9a-f]{64}")
_ID = re.compile(r"[0-9a-f]{32}")
_OBJECT = re.compile(r"index/(ops/[0-9a-f]{32}\.(add|del)|base/[0-9]{20}-[0-9a-f]{32}\.kvix)")


class IndexCorrupt(KvcdnError):
    """An index object that is not one this version wrote: refused, never half-read."""


@dataclasses.dataclass(frozen=True)
class Hit:
    """One artifact sharing a prefix with the query; ``prefix_tokens`` is exact to the token."""

    name: str
    root: str
    prefix_tokens: int
    usable_tokens: int
    token_count: int
    reuse: str
    compute_dtype: str | None = None
    quantization: str | None = None
    #: where a remote index found it (the hosted artifact id), for fetching it
    ref: str | None = None
    #: False when the remote index could not compare every candidate (a longer match may exist)
    complete: bool = True

    def sort_key(self) -> tuple:
        """The order of :func:`kvcdn_core.search.rank`: usable, prefix, usable fraction, unquantized, name."""
        fraction = self.usable_tokens / self.token_count if self.token_count else 0.0
        return (-self.usable_tokens, -self.prefix_tokens, -fraction, self.quantization is not None, self.name)


def usable(prefix: int, token_count: int, query_tokens: int, reuse: str) -> int:
    """Tokens a continuation can take (as :func:`kvcdn_core.search.usable_tokens`, kept torch- and search-free)."""
    cap = max(query_tokens - 1, 0)
    if reuse == ANY_PREFIX:
        return min(prefix, cap)
    return token_count if prefix == token_count and token_count <= cap else 0


# -- object encoding: magic, u64 JSON length, JSON, padding to 8, arrays -----------------------------


def _pack(magic: bytes, meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    specs = [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]
    blob = json.dumps({**meta, "arrays": specs}, separators=(",", ":")).encode()
    head = magic + struct.pack("<Q", len(blob)) + blob
    parts = [head, b"\0" * ((-len(head)) % 8)]
    for a in arrays.values():
        raw = np.ascontiguousarray(a).tobytes()
        parts += [raw, b"\0" * ((-len(raw)) % 8)]
    return b"".join(parts)


_DTYPES = {"<u4", "<i4", "<i8", "|S16", "|u1"}


def _unpack(key: str, magic: bytes, data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    def bad(why: str) -> IndexCorrupt:
        return IndexCorrupt(
            f"index object '{key}' is corrupted or foreign ({why}); rebuild the index (kvcdn store check --repair)"
        )

    if data[:8] != magic:
        raise bad("wrong magic")
    try:
        (n,) = struct.unpack_from("<Q", data, 8)
        if n > len(data):
            raise bad("truncated")
        meta = json.loads(data[16 : 16 + n])
        if not isinstance(meta, dict) or meta.get("v") != VERSION:
            raise bad(f"version {meta.get('v') if isinstance(meta, dict) else '?'}, this kvcdn reads {VERSION}")
        offset = 16 + n
        offset += (-offset) % 8
        arrays = {}
        for name, dtype, shape in meta.pop("arrays"):
            if dtype not in _DTYPES or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise bad(f"array '{name}'")
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            size = count * dt.itemsize
            if offset + size > len(data):
                raise bad("truncated")
            arrays[str(name)] = np.frombuffer(data, dtype=dt, count=count, offset=offset).reshape(shape)
            offset += size + (-size) % 8
        return meta, arrays
    except IndexCorrupt:
        raise
    except (ValueError, TypeError, KeyError, struct.error) as exc:
        raise bad(type(exc).__name__) from None


# -- the operations: what add and remove write -------------------------------------------------------


@dataclasses.dataclass
class _Art:
    """One indexed artifact: its edges (any-prefix) or its whole-prefix anchor and remaining tokens."""

    id: str
    name: str
    root: str
    token_count: int
    reuse: str
    at: int
    edges: list[tuple[bytes, np.ndarray]]  # (16-byte chain key, token ids) per chunk, any-prefix only
    anchor: bytes = b""  # whole-prefix: key of its last whole chunk (or its root)
    rest: np.ndarray | None = None  # whole-prefix: its tokens after the anchor


def _k16(hexkey: str) -> bytes:
    return bytes.fromhex(hexkey)[:KEY_BYTES]


def _art_from_ids(op_id, name, root, reuse, at, ids: np.ndarray, chunk_tokens: int) -> _Art:
    keys = chainkeys.chain(root, ids, chunk_tokens)
    if reuse == ANY_PREFIX:
        edges = [(_k16(k), ids[i * chunk_tokens : (i + 1) * chunk_tokens]) for i, k in enumerate(keys)]
        return _Art(op_id, name, root, int(ids.size), reuse, at, edges)
    whole = ids.size // chunk_tokens
    anchor = _k16(keys[whole - 1]) if whole else _k16(root)
    return _Art(op_id, name, root, int(ids.size), reuse, at, [], anchor, ids[whole * chunk_tokens :])


def _describe(record) -> dict[str, Any]:
    """Model, compute dtype and quantization of a record, for the roots table (search picks roots by them)."""
    compute_dtype = getattr(record, "compute_dtype", None)
    quantization = getattr(record, "quantization", None)
    header = getattr(record, "header", None)
    if compute_dtype is None and isinstance(header, str):
        try:
            manifest = json.loads(json.loads(header)["__metadata__"]["kvcdn.manifest"])
            compute_dtype = manifest.get("compute_dtype")
            quant = manifest.get("quantization")
            quantization = quant.get("scheme") if isinstance(quant, dict) and quant else None
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    return {
        "model": dict(getattr(record, "model", None) or {}),
        "compute_dtype": compute_dtype,
        "quantization": quantization if isinstance(quantization, str) or quantization is None else None,
    }


def _check_ids(token_ids) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max)):
        raise KvcdnError("token ids must be a flat sequence of non-negative 32-bit integers")
    return ids


def add(backend, record, token_ids, now: Callable[[], int] = time.time_ns) -> str:
    """Index ``record`` (an :class:`ArtifactRecord` or anything with ``name``, ``root``, ``reuse``,
    ``chunk_tokens``, ``model``) under its token ids: one new write-once object. Returns its id.

    Called after the record is written, so a reader that finds the artifact in the index finds its
    record and chunks.
    """
    ids = _check_ids(token_ids)
    name, root, reuse = str(record.name), str(record.root), str(record.reuse)
    chunk_tokens = int(getattr(record, "chunk_tokens", chainkeys.CHUNK_TOKENS))
    if not name or not _HEX.fullmatch(root) or reuse not in _REUSE or chunk_tokens <= 0:
        raise KvcdnError(f"cannot index '{name}': bad name, root, reuse rule or chunk size")
    token_count = int(getattr(record, "token_count", ids.size))
    if token_count != ids.size:
        raise KvcdnError(f"cannot index '{name}': the record says {token_count} tokens, {ids.size} given")
    op_id = uuid.uuid4().hex
    meta = {
        "v": VERSION,
        "op": "add",
        "id": op_id,
        "name": name,
        "root": root,
        "reuse": reuse,
        "chunk_tokens": chunk_tokens,
        "at": int(now()),
        **_describe(record),
    }
    backend.write_bytes(f"{OPS}{op_id}.add", _pack(OP_MAGIC, meta, {"ids": ids.astype("<u4")}))
    _changed(backend)
    if len(backend.list(OPS)) > COMPACT_AFTER:
        compact(backend)
    return op_id


def remove(backend, record, token_ids=None) -> int:
    """Cancel every indexed add of ``record.name`` (one new write-once object); returns how many.

    ``token_ids`` is accepted for symmetry with :func:`add` and not needed: the cancelled adds are
    named by id.
    """
    name = str(getattr(record, "name", record))
    index = load(backend)
    targets = sorted(a for a, art in index.state.arts.items() if art.name == name)
    if targets:
        op_id = uuid.uuid4().hex
        meta = {"v": VERSION, "op": "del", "id": op_id, "name": name, "targets": targets}
        backend.write_bytes(f"{OPS}{op_id}.del", _pack(OP_MAGIC, meta, {}))
        _changed(backend)
    return len(targets)


def _changed(backend) -> None:
    """Tell every reader the index changed: a new mark, written after the change is durable, so a
    reader that sees the mark it listed under has listed every change made before it."""
    backend.write_bytes(MARK, uuid.uuid4().hex.encode())


# -- the merged state: every operation read, minus the cancelled ones -------------------------------


@dataclasses.dataclass
class _State:
    chunk_tokens: int | None = None
    arts: dict[str, _Art] = dataclasses.field(default_factory=dict)  # live adds by id
    dead: set[str] = dataclasses.field(default_factory=set)  # cancelled add ids, kept forever
    roots: dict[str, dict] = dataclasses.field(default_factory=dict)

    def _chunk(self, key: str, chunk_tokens) -> int:
        if not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
            raise IndexCorrupt(f"index object '{key}' is corrupted (chunk size)")
        if self.chunk_tokens not in (None, chunk_tokens):
            raise IndexCorrupt(
                f"index object '{key}' uses {chunk_tokens}-token chunks, the index {self.chunk_tokens}; "
                "rebuild the index (kvcdn store check --repair)"
            )
        self.chunk_tokens = chunk_tokens
        return chunk_tokens

    def merge_object(self, key: str, data: bytes) -> None:
        if key.startswith(BASES):
            self.merge_base(key, *_unpack(key, BASE_MAGIC, data))
            return
        meta, arrays = _unpack(key, OP_MAGIC, data)
        try:
            if meta["op"] == "del":
                targets = [str(t) for t in meta["targets"]]
                if not all(_ID.fullmatch(t) for t in targets):
                    raise ValueError
                self.dead.update(targets)
                for t in targets:
                    self.arts.pop(t, None)
                return
            op_id, name, root, reuse, at = meta["id"], meta["name"], meta["root"], meta["reuse"], int(meta["at"])
            ids = arrays["ids"].astype(np.int64)
            ok = (
                meta["op"] == "add"
                and _ID.fullmatch(op_id)
                and key == f"{OPS}{op_id}.add"
                and isinstance(name, str)
                and name
                and _HEX.fullmatch(root)
                and reuse in _REUSE
                and ids.ndim == 1
                and (not ids.size or ids.max() <= np.iinfo(np.int32).max)
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise IndexCorrupt(f"index object '{key}' is corrupted (operation fields); rebuild the index")
        chunk_tokens = self._chunk(key, meta["chunk_tokens"])
        self.roots.setdefault(
            root, {k: meta.get(k) for k in ("model", "compute_dtype", "quantization")} | {"root": root}
        )
        if op_id not in self.dead:
            self.arts[op_id] = _art_from_ids(op_id, name, root, reuse, at, ids, chunk_tokens)

    def merge_base(self, key: str, meta: dict, a: dict[str, np.ndarray]) -> None:
        try:
            if meta["arts"]:  # a base without artifacts fixes no chunk size
                self._chunk(key, meta["chunk_tokens"])
            roots = [dict(r) for r in meta["roots"]]
            self.dead.update(str(d) for d in meta["dead"])
            node_key, parent = a["node_key"], a["parent"].astype(np.int64)
            tok_off, tok_len, tokens = a["tok_off"], a["tok_len"], a["tokens"]
            n_roots, n_nodes = len(roots), node_key.shape[0]
            if not (
                parent.shape == (n_nodes - n_roots,) == tok_off.shape == tok_len.shape
                and np.all(parent < np.arange(n_roots, n_nodes))
                and np.all(parent >= 0)
                and np.all(tok_off >= 0)
                and np.all(tok_off + tok_len <= tokens.size)
                and a["art_node"].shape == a["anchor"].shape == (len(meta["arts"]),)
                and np.all(a["art_node"] < n_nodes)
            ):
                raise ValueError
            for r in roots:
                if not _HEX.fullmatch(r["root"]):
                    raise ValueError
                self.roots.setdefault(r["root"], r)
            for i, row in enumerate(meta["arts"]):
                op_id, name, root_i, token_count, reuse_i, at = row
                if not _ID.fullmatch(op_id) or op_id in self.dead:
                    continue
                reuse, root = _REUSE[reuse_i], roots[root_i]["root"]
                node = int(a["art_node"][i])
                if reuse == ANY_PREFIX:
                    edges = []
                    while node >= n_roots:
                        e = node - n_roots
                        edges.append((_kb(node_key[node]), tokens[tok_off[e] : tok_off[e] + tok_len[e]]))
                        node = int(parent[e])
                    edges.reverse()
                    art = _Art(op_id, str(name), root, int(token_count), reuse, int(at), edges)
                else:
                    off, n = int(a["rest_off"][i]), int(a["rest_len"][i])
                    if off < 0 or off + n > tokens.size:
                        raise ValueError
                    rest = tokens[off : off + n].astype(np.int64)
                    art = _Art(op_id, str(name), root, int(token_count), reuse, int(at), [], _kb(a["anchor"][i]), rest)
                if reuse == ANY_PREFIX and art.token_count != sum(t.size for _, t in art.edges):
                    raise ValueError
                self.arts[op_id] = art
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise IndexCorrupt(
                f"index object '{key}' is corrupted ({type(exc).__name__}); rebuild the index "
                "(kvcdn store check --repair)"
            ) from None


# -- the frozen trie: arrays a lookup walks ----------------------------------------------------------


def _be(tokens: np.ndarray) -> bytes:
    """Big-endian bytes: their byte order is the token ids' lexicographic order (shorter first)."""
    return np.asarray(tokens, dtype=">u4").tobytes()


class _Trie:
    """The index as arrays: nodes (roots first, then edges in breadth-first order, each node's
    children contiguous and sorted by tokens), the sorted key table, and per node the best artifact."""

    def __init__(self, state: _State):
        # None until an artifact is indexed: a base written before any add (a compaction that listed
        # only cancellations, or nothing) must not fix the chunk size of the adds that come after it
        self.declared_chunk_tokens = state.chunk_tokens
        self.chunk_tokens = state.chunk_tokens or chainkeys.CHUNK_TOKENS
        latest: dict[str, _Art] = {}
        self.superseded: set[str] = set()
        for art in state.arts.values():  # a name indexed twice without a remove: the newest wins
            old = latest.get(art.name)
            if old is None or (art.at, art.id) > (old.at, old.id):
                latest[art.name] = art
                if old is not None:
                    self.superseded.add(old.id)
            else:
                self.superseded.add(art.id)
        arts = sorted(latest.values(), key=lambda x: (x.token_count, x.name))
        self.arts = arts
        self.root_list = sorted(state.roots)
        self.root_meta = [state.roots[r] for r in self.root_list]
        node_keys = [_k16(r) for r in self.root_list]
        self.root_index = {r: i for i, r in enumerate(self.root_list)}
        children: dict[bytes, dict[bytes, np.ndarray]] = {}
        ends: dict[bytes, list[int]] = {}
        for rank, art in enumerate(arts):
            parent = _k16(art.root)
            for k, toks in art.edges:
                children.setdefault(parent, {}).setdefault(k, toks)
                parent = k
            if art.edges:
                ends.setdefault(parent, []).append(rank)
        # breadth-first numbering: a node's children are contiguous, sorted by their tokens
        parent_of, edge_tokens = [], []
        i = 0
        while i < len(node_keys):
            kids = children.get(node_keys[i])
            if kids:
                for k, toks in sorted(kids.items(), key=lambda kv: _be(kv[1])):
                    node_keys.append(k)
                    parent_of.append(i)
                    edge_tokens.append(toks)
            i += 1
        n_roots = len(self.root_list)
        self.n_roots = n_roots
        self.node_key = np.array(node_keys, dtype="S16") if node_keys else np.zeros(0, "S16")
        self.parent = np.array(parent_of, dtype=np.int32)
        lens = np.array([t.size for t in edge_tokens], dtype=np.int32)
        self.tok_len = lens
        self.tok_off = (
            np.concatenate([[0], np.cumsum(lens, dtype=np.int64)[:-1]]) if lens.size else lens.astype(np.int64)
        )
        self.tokens = np.concatenate(edge_tokens).astype(np.uint32) if edge_tokens else np.zeros(0, np.uint32)
        self.art_node = np.full(len(arts), -1, dtype=np.int64)
        slot = {k: j for j, k in enumerate(node_keys[n_roots:], start=n_roots)}
        for k, ranks in ends.items():
            self.art_node[ranks] = slot[k]
        self.rest: dict[int, np.ndarray] = {}
        for rank, art in enumerate(arts):
            if art.reuse == WHOLE_PREFIX:
                self.rest[rank] = np.asarray(art.rest, dtype=np.int64)
        self._derive()

    @classmethod
    def from_base(cls, key: str, meta: dict, a: dict[str, np.ndarray]) -> _Trie:
        """The trie of a base object as it is stored (no rebuild: the base is the trie's arrays)."""
        self = cls.__new__(cls)
        try:
            rows = meta["arts"]
            declared = meta["chunk_tokens"]  # a base without artifacts fixes no chunk size
            if declared is not None or rows:
                declared = int(declared)
                if declared <= 0:
                    raise ValueError
            self.declared_chunk_tokens = declared if rows else None
            self.chunk_tokens = self.declared_chunk_tokens or chainkeys.CHUNK_TOKENS
            self.root_meta = [dict(r) for r in meta["roots"]]
            self.root_list = [str(r["root"]) for r in self.root_meta]
            self.root_index = {r: i for i, r in enumerate(self.root_list)}
            self.superseded = set()
            self.n_roots = n_roots = len(self.root_list)
            self.node_key, self.parent = a["node_key"], a["parent"].astype(np.int64)
            self.tok_off, self.tok_len = a["tok_off"].astype(np.int64), a["tok_len"].astype(np.int64)
            n, tokens = self.node_key.shape[0], a["tokens"]
            edges_end = int((self.tok_off + self.tok_len).max()) if self.tok_off.size else 0
            self.tokens = tokens[:edges_end]
            self.art_node = a["art_node"].astype(np.int64)
            if not (
                self.root_list == sorted(self.root_list)
                and all(_HEX.fullmatch(r) for r in self.root_list)
                and self.parent.shape == (n - n_roots,) == self.tok_off.shape == self.tok_len.shape
                and np.all(self.parent >= 0)
                and np.all(self.parent < np.arange(n_roots, n))
                and np.all(np.diff(self.parent) >= 0)
                and np.all(self.tok_off >= 0)
                and edges_end <= tokens.size
                and self.art_node.shape == a["anchor"].shape == a["rest_off"].shape == (len(rows),)
                and np.all(self.art_node < n)
            ):
                raise ValueError
            self.arts, self.rest = [], {}
            art_node = self.art_node.tolist()  # Python ints: one numpy scalar per row costs more than the row
            for i, (op_id, name, root_i, token_count, reuse_i, at) in enumerate(rows):
                reuse = _REUSE[reuse_i]
                art = _Art(str(op_id), str(name), self.root_list[root_i], int(token_count), reuse, int(at), [])
                if reuse == WHOLE_PREFIX:
                    off, size = int(a["rest_off"][i]), int(a["rest_len"][i])
                    if off < 0 or off + size > tokens.size:
                        raise ValueError
                    art.anchor, art.rest = _kb(a["anchor"][i]), tokens[off : off + size].astype(np.int64)
                    self.rest[i] = art.rest
                    self.art_node[i] = -1
                elif (art_node[i] != -1) if not int(token_count) else (art_node[i] < n_roots):
                    # an any-prefix artifact of no tokens ends on no edge (its node is -1)
                    raise ValueError
                self.arts.append(art)
            order = [(x.token_count, x.name) for x in self.arts]
            if order != sorted(order):
                raise ValueError
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise IndexCorrupt(
                f"index object '{key}' is corrupted ({type(exc).__name__}); rebuild the index "
                "(kvcdn store check --repair)"
            ) from None
        self._derive()
        return self

    def _derive(self) -> None:
        """What a lookup needs beyond the stored arrays: children ranges, the artifacts ending at each
        node, the best artifact below each node, children by their best, the sorted key table."""
        n_roots, n = self.n_roots, self.node_key.shape[0]
        idx = np.arange(n, dtype=np.int64)
        self.child_lo = np.searchsorted(self.parent, idx, side="left").astype(np.int64)
        self.child_hi = np.searchsorted(self.parent, idx, side="right").astype(np.int64)
        ranks = np.flatnonzero(self.art_node >= 0)
        ends = self.art_node[ranks]
        order = np.argsort(ends, kind="stable")
        self.term_rank, term_node = ranks[order], ends[order]
        self.term_lo = np.searchsorted(term_node, idx, side="left")
        self.term_hi = np.searchsorted(term_node, idx, side="right")
        self.rep = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(self.rep, ends, ranks)
        levels, lo, hi = [], 0, n_roots  # breadth-first: each depth is a contiguous range of nodes
        while lo < hi:
            start, end = int(self.child_lo[lo]) + n_roots, int(self.child_hi[hi - 1]) + n_roots
            if start >= end:
                break
            levels.append((start, end))
            lo, hi = start, end
        for start, end in reversed(levels):
            np.minimum.at(self.rep, self.parent[start - n_roots : end - n_roots], self.rep[start:end])
        self.byrep = (
            np.lexsort((self.rep[n_roots:], self.parent)).astype(np.int64) + n_roots if n > n_roots else idx[:0]
        )
        order = np.argsort(self.node_key[n_roots:], kind="stable")
        self.sorted_keys = self.node_key[n_roots:][order]
        self.sorted_node = order.astype(np.int64) + n_roots
        self.anchors: dict[bytes, list[int]] = {}
        for rank in sorted(self.rest):
            self.anchors.setdefault(self.arts[rank].anchor, []).append(rank)
        self.nbytes = sum(
            x.nbytes for x in (self.node_key, self.parent, self.tok_len, self.tok_off, self.tokens)
        ) + sum(r.size * 4 for r in self.rest.values())

    @functools.cached_property
    def names(self) -> frozenset[str]:
        return frozenset(a.name for a in self.arts)

    @functools.cached_property
    def rank_of(self) -> dict[str, int]:
        """Each artifact's rank by its add's id (a remove names the adds it cancels)."""
        return {a.id: rank for rank, a in enumerate(self.arts)}

    # -- lookup ---------------------------------------------------------------------------------------

    def edge_tokens(self, node: int) -> np.ndarray:
        e = node - self.n_roots
        return self.tokens[self.tok_off[e] : self.tok_off[e] + self.tok_len[e]]

    def probe(self, keys16: list[bytes]) -> np.ndarray:
        """Node of each key, -1 where absent (one binary search each)."""
        if not keys16 or not self.sorted_keys.size:
            return np.full(len(keys16), -1, dtype=np.int64)
        q = np.array(keys16, dtype="S16")
        pos = np.searchsorted(self.sorted_keys, q)
        pos_c = np.minimum(pos, self.sorted_keys.size - 1)
        return np.where(self.sorted_keys[pos_c] == q, self.sorted_node[pos_c], -1)

    def best_child_range(self, node: int, t: np.ndarray) -> tuple[int, int, int]:
        """Children of ``node`` sharing the most leading tokens with ``t``: (lo, hi, shared)."""
        lo, hi = int(self.child_lo[node]), int(self.child_hi[node])
        if lo == hi or not t.size:
            return lo, lo, 0
        tb = _be(t)
        a, b = lo, hi  # first child whose tokens sort after t
        while a < b:
            mid = (a + b) // 2
            if _be(self.edge_tokens(mid + self.n_roots)) <= tb:
                a = mid + 1
            else:
                b = mid
        best = 0
        for c in (a - 1, a):
            if lo <= c < hi:
                best = max(best, _lcp(self.edge_tokens(c + self.n_roots), t))
        if not best:
            return lo, lo, 0
        head = tb[: 4 * best]
        # the children sharing ``best`` tokens are those whose first ``best`` tokens equal t's: a range
        first = _bisect(lo, a, lambda c: _be(self.edge_tokens(c + self.n_roots))[: 4 * best] < head)
        last = _bisect(a, hi, lambda c: _be(self.edge_tokens(c + self.n_roots))[: 4 * best] == head)
        return first, last, best

    def sharing(self, root: str, query: np.ndarray, tokens: int) -> list[int]:
        """Ranks of every artifact with edges under ``root`` whose first ``tokens`` (at least 1) token
        ids are the query's: the nodes reached by the query's whole chunks before that token, then
        the range of children agreeing on the rest (the children are sorted by their tokens)."""
        r = self.root_index.get(root)
        if r is None or tokens < 1 or query.size < tokens:
            return []
        c = self.chunk_tokens
        whole = (tokens - 1) // c
        node = r
        if whole:
            found = self.probe([_k16(k) for k in chainkeys.full_chain(root, query[: whole * c], c)])
            if found[-1] < 0:  # chain keys: the last chunk present means every chunk before it is
                return []
            node = int(found[-1])
        need = 4 * (tokens - whole * c)
        head = _be(query[whole * c : whole * c + need // 4])
        lo, hi = int(self.child_lo[node]), int(self.child_hi[node])
        first = _bisect(lo, hi, lambda ch: _be(self.edge_tokens(ch + self.n_roots))[:need] < head)
        last = _bisect(first, hi, lambda ch: _be(self.edge_tokens(ch + self.n_roots))[:need] == head)
        return self.walk(list(range(first + self.n_roots, last + self.n_roots)), len(self.arts))

    def walk(self, starts: list[int], limit: int) -> list[int]:
        """Up to ``limit`` artifact ranks below the ``starts`` nodes, best first."""
        return list(itertools.islice(self.ranks_below(starts), limit))

    def ranks_below(self, starts: Iterable[int]) -> Iterator[int]:
        """The artifact ranks below the ``starts`` nodes, best first (a heap over subtree bests):
        lazily, so a caller skipping removed artifacts walks only as far as it needs."""
        heap: list[tuple[int, int, int, int]] = []  # (rank, kind, node, position)
        for s in starts:
            heap.append((int(self.rep[s]), 0, s, 0))
        heapq.heapify(heap)
        while heap:
            rank, kind, node, pos = heapq.heappop(heap)
            if kind == 0:  # a subtree: its own ends, and its children by their bests
                t = int(self.term_lo[node])
                if t < int(self.term_hi[node]):
                    heapq.heappush(heap, (int(self.term_rank[t]), 1, node, t))
                lo, hi = int(self.child_lo[node]), int(self.child_hi[node])
                if lo < hi:
                    heapq.heappush(heap, (int(self.rep[self.byrep[lo]]), 2, node, lo))
            elif kind == 1:  # the artifacts ending at a node
                yield rank
                if pos + 1 < int(self.term_hi[node]):
                    heapq.heappush(heap, (int(self.term_rank[pos + 1]), 1, node, pos + 1))
            else:  # the next child of a node
                child = int(self.byrep[pos])
                heapq.heappush(heap, (int(self.rep[child]), 0, child, 0))
                if pos + 1 < int(self.child_hi[node]):
                    heapq.heappush(heap, (int(self.rep[self.byrep[pos + 1]]), 2, node, pos + 1))

    def lookup(
        self, root: str, query: np.ndarray, start_tokens: int, limit: int, hidden: AbstractSet[int] = frozenset()
    ) -> list[Hit]:
        """The artifacts sharing the longest prefix with ``query`` (up to ``limit``, rank order) and
        every whole-prefix artifact it holds whole; none of the ``hidden`` ranks (removed since this
        trie was built): where they were the longest, the next longest live prefix answers."""
        r = self.root_index.get(root)
        if r is None or not query.size:
            return []
        c = self.chunk_tokens
        full = chainkeys.full_chain(root, query, c)
        keys16 = [_k16(k) for k in full]
        nodes = self.probe(keys16)
        missing = np.flatnonzero(nodes < 0)
        depth = int(missing[0]) if missing.size else len(full)  # chain: chunk i present => all before it
        path = [r, *(int(x) for x in nodes[:depth])]
        meta = self.root_meta[r]
        hits = []
        for prefix, starts, ends in self.by_shared_prefix(path, query):
            if prefix <= start_tokens:
                break
            if len(starts) > limit + len(hidden):  # only that many best subtrees can hold the answer
                starts = starts[np.argpartition(self.rep[starts], limit + len(hidden) - 1)[: limit + len(hidden)]]
            ranks = heapq.merge(self.ranks_below(int(x) for x in starts), (int(x) for x in ends))
            live = list(itertools.islice((x for x in ranks if x not in hidden), limit))
            if live:
                hits = [self._hit(self.arts[rank], meta, prefix, query.size) for rank in live]
                break
        # whole-prefix artifacts the query contains whole, anchored on the root or one of its chunks
        for d, anchor in enumerate([_k16(root), *keys16]):
            for rank in self.anchors.get(anchor, ()):
                art, rest = self.arts[rank], self.rest[rank]
                if art.root != root or rank in hidden:
                    continue
                piece = query[d * c : d * c + rest.size]
                if piece.size == rest.size and np.array_equal(piece, rest) and art.token_count > start_tokens:
                    hits.append(self._hit(art, meta, art.token_count, query.size))
        return hits

    def by_shared_prefix(self, path: list[int], query: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """The any-prefix artifacts near the query's ``path`` (its root, then the node of each whole
        chunk it shares) in groups sharing the same number of tokens with it, most first: (tokens,
        subtree nodes, ranks ending at a node). A lookup stops at the first group with a live
        artifact, almost always the first; the others are walked only past removed artifacts."""
        c, nr = self.chunk_tokens, self.n_roots
        for d in range(len(path) - 1, -1, -1):
            node, t = path[d], query[d * c : (d + 1) * c]
            lo, hi = int(self.child_lo[node]), int(self.child_hi[node])
            if d + 1 < len(path):  # the child on the path shares the whole chunk: its group came before
                first, last = path[d + 1] - nr, path[d + 1] - nr + 1
            else:
                first, last, shared = self.best_child_range(node, t)
                if not shared:  # no child shares a token: the whole subtree shares d chunks
                    yield d * c, np.array([node]), np.zeros(0, np.int64)
                    continue
                yield d * c + shared, np.arange(first, last) + nr, np.zeros(0, np.int64)
            while True:  # widen the range of children sharing the most tokens, one count at a time
                shared = max(
                    _lcp(self.edge_tokens(first - 1 + nr), t) if first > lo else 0,
                    _lcp(self.edge_tokens(last + nr), t) if last < hi else 0,
                )
                if not shared:
                    break
                head = _be(t[:shared])
                wider_first = _bisect(lo, first, lambda ch: _be(self.edge_tokens(ch + nr))[: 4 * shared] < head)
                wider_last = _bisect(last, hi, lambda ch: _be(self.edge_tokens(ch + nr))[: 4 * shared] == head)
                yield d * c + shared, np.r_[wider_first:first, last:wider_last] + nr, np.zeros(0, np.int64)
                first, last = wider_first, wider_last
            ends = self.term_rank[int(self.term_lo[node]) : int(self.term_hi[node])]
            yield d * c, np.r_[lo:first, last:hi] + nr, ends

    @staticmethod
    def _hit(art: _Art, meta: dict, prefix: int, q: int) -> Hit:
        return Hit(
            art.name,
            art.root,
            prefix,
            usable(prefix, art.token_count, q, art.reuse),
            art.token_count,
            art.reuse,
            meta.get("compute_dtype"),
            meta.get("quantization"),
        )

    # -- the base object ------------------------------------------------------------------------------

    def to_base(self, dead: Iterable[str]) -> bytes:
        """The trie as a base object, with the cancelled ids (and the adds a newer one replaced)."""
        rests = [self.rest.get(i, np.zeros(0, np.int64)) for i in range(len(self.arts))]
        rest_len = np.array([r.size for r in rests], dtype=np.int64)
        rest_off = self.tokens.size + np.concatenate([[0], np.cumsum(rest_len)[:-1]]).astype(np.int64)
        tokens = np.concatenate([self.tokens, *[r.astype(np.uint32) for r in rests]])
        anchor = np.array([a.anchor for a in self.arts], dtype="S16")
        meta = {
            "v": VERSION,
            "chunk_tokens": self.declared_chunk_tokens,
            "roots": self.root_meta,
            "arts": [
                [a.id, a.name, self.root_index[a.root], a.token_count, _REUSE.index(a.reuse), a.at] for a in self.arts
            ],
            "dead": sorted(set(dead) | self.superseded),
        }
        arrays = {
            "node_key": self.node_key,
            "parent": self.parent.astype("<i4"),
            "tok_off": self.tok_off.astype("<i8"),
            "tok_len": self.tok_len.astype("<i4"),
            "tokens": tokens.astype("<u4"),
            "art_node": self.art_node.astype("<i8"),
            "anchor": anchor,
            "rest_off": rest_off.astype("<i8")[: len(self.arts)],
            "rest_len": rest_len.astype("<i8"),
        }
        return _pack(BASE_MAGIC, meta, arrays)


def _kb(x) -> bytes:
    """A 16-byte key read back from an ``S16`` array (numpy drops trailing zero bytes)."""
    return bytes(x).ljust(KEY_BYTES, b"\0")


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _bisect(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """First position in [lo, hi) where ``pred`` turns false (``pred`` true then false along the range)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


# -- loading, cached per backend ---------------------------------------------------------------------


#: Adds kept in the recent layers at most before the whole trie is rebuilt (as many as a compaction
#: folds: another writer's compaction usually comes first)
RECENT_MAX = COMPACT_AFTER
#: Adds in the newest layer at most: more, and it is merged into the recent one (each new add
#: rebuilds the newest layer, so it stays small; the recent one is rebuilt once per this many)
NEWEST_MAX = 32
#: Artifacts of the main layer removed since it was built, hidden from its lookups, at most: more,
#: and the whole trie is rebuilt (a lookup whose best matches were removed walks past them)
HIDDEN_MAX = COMPACT_AFTER


@dataclasses.dataclass
class Loaded:
    """The index as last read from one backend: the objects read, the merged state, and the trie in
    layers. ``main`` holds what was read at the last full build (or a base taken as stored), less
    the ``hidden`` artifacts removed since; ``recent`` and ``newest`` the adds read since (None:
    none). A lookup asks every layer: rebuilding the whole trie for each change would cost every
    reader time in proportion to the store at its next lookup after any other writer's put (0.5 s
    at 10,200 artifacts) or remove (0.37 s at 10,000)."""

    seen: set[str]
    state: _State
    main: _Trie
    bytes_read: int
    lazy: tuple[str, bytes] | None = None  # a lone base taken as it is: its artifacts carry no edges
    #: the change mark read before the listing this was made from (None: the store has none),
    #: and when (:func:`_clock`)
    mark: bytes | None = None
    listed_at: float = 0.0
    recent: _Trie | None = None
    recent_ids: frozenset[str] = frozenset()
    #: the latest adds, kept apart from ``recent`` so that each add rebuilds a small trie
    newest: _Trie | None = None
    newest_ids: frozenset[str] = frozenset()
    #: ranks of ``main``'s artifacts removed since it was built: its lookups pass over them
    hidden: frozenset[int] = frozenset()

    @property
    def trie(self) -> _Trie:
        """The whole index as one trie (compaction, stats), built on each call: ``main`` when
        nothing was added or removed since it was built."""
        if self.recent is None and self.newest is None and not self.hidden:
            return self.main
        return _Trie(self.complete())

    def complete(self) -> _State:
        """A copy of the merged state with every artifact's edges (a lazily taken base decoded)."""
        old = self.state
        if self.lazy is None:
            return _State(old.chunk_tokens, dict(old.arts), set(old.dead), dict(old.roots))
        state = _State(dead=set(old.dead))  # what was removed since the base stays out
        state.merge_object(*self.lazy)
        for op_id in (self.recent_ids | self.newest_ids) & old.arts.keys():
            state.arts[op_id] = old.arts[op_id]
        state.chunk_tokens = state.chunk_tokens or old.chunk_tokens
        for root, meta in old.roots.items():
            state.roots.setdefault(root, meta)
        return state

    def root_meta(self) -> list[dict]:
        return [self.state.roots[r] for r in sorted(self.state.roots)]

    def lookup(self, root: str, query: np.ndarray, start_tokens: int, limit: int) -> list[Hit]:
        """The layers' hits as one trie over their union would give them (no name is in two layers):
        the artifacts sharing the longest prefix, merged in rank order; whole-prefix hits of all."""
        hits = self.main.lookup(root, query, start_tokens, limit, self.hidden)
        if self.recent is None and self.newest is None:
            return hits
        for layer in (self.recent, self.newest):
            hits += layer.lookup(root, query, start_tokens, limit) if layer is not None else []
        anyp = [h for h in hits if h.reuse == ANY_PREFIX]
        longest = max((h.prefix_tokens for h in anyp), default=0)
        best = sorted((h for h in anyp if h.prefix_tokens == longest), key=lambda h: (h.token_count, h.name))
        return best[:limit] + [h for h in hits if h.reuse != ANY_PREFIX]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _index_objects(backend) -> dict[str, int]:
    """Every index object: the operations listed first, then the bases. A listing is not atomic (a
    directory walk, S3's pages), and a compaction writes its base before it deletes the operations
    it folded: so an operation gone from the first listing is in a base the second one finds, where
    one walk over both folders, bases first, could miss it in both."""
    found = {}
    for prefix in (OPS, BASES):
        for info in backend.list(prefix):
            if _OBJECT.fullmatch(info.key):
                found[info.key] = info.size
    return found


def load(backend, refresh: bool = True) -> Loaded:
    """The index of ``backend``: the cached one when no index object changed, else re-read.

    Only objects not read before are read (the index is a union: what was read stays true). An
    object deleted between the listing and the read was folded into a newer base: list again. The
    change mark (:data:`MARK`) is read before the listing; while it stays the same, nothing is
    listed. A store without one (written by a kvcdn before the mark) is listed every time.
    """
    with _LOCK:
        cached = _CACHE.get(backend)
    if cached is not None and not refresh:
        return cached
    for _ in range(20):
        now = _clock()
        mark = backend.read_bytes(MARK)
        if cached is not None and mark is not None and mark == cached.mark and now - cached.listed_at < RELIST_S:
            return cached
        objects = _index_objects(backend)
        known = cached.seen if cached is not None else set()
        new = sorted(k for k in objects if k not in known)
        if cached is not None and not new:
            cached = dataclasses.replace(cached, mark=mark, listed_at=now)
            _keep(backend, cached)
            return cached
        if any(k.startswith(BASES) for k in new):  # compacted: take the base as it is, if it can be
            fresh = _on_base(backend, cached, objects, mark, now)
            if fresh is _VANISHED:
                continue
            if isinstance(fresh, Loaded):
                _keep(backend, fresh)
                return fresh
        keys = sorted(new, key=lambda k: (not k.startswith(BASES), k))  # bases first
        blobs = _read_each(backend, keys)
        got = [(key, data) for key, data in zip(keys, blobs) if data is not None]
        if len(got) < len(keys):
            continue
        read = (cached.bytes_read if cached else 0) + sum(len(data) for _, data in got)
        layered = _with_recent(cached, got, read, mark, now) if cached is not None else None
        if layered is not None:
            _keep(backend, layered)
            return layered
        state = cached.complete() if cached is not None else _State()  # the whole trie, built anew
        for key, data in got:
            state.merge_object(key, data)
        for dead in state.dead & state.arts.keys():
            state.arts.pop(dead)
        loaded = Loaded(known | set(new), state, _Trie(state), read, None, mark, now)
        _keep(backend, loaded)
        return loaded
    raise KvcdnError("the index kept changing while it was read; try again")


#: what :func:`_on_base` returns when an object it listed was gone when read: list again
_VANISHED = object()
#: Index objects read at once: on an object store each is a round trip, and a new reader reads
#: up to 256 operations (1.1 s one at a time on S3 over loopback)
READERS = 8


def _read_each(backend, keys: list[str]) -> list[bytes | None]:
    """Each object's bytes (None where it is gone), read concurrently (backends are thread-safe)."""
    if len(keys) < 2:
        return [backend.read_bytes(key) for key in keys]
    return list(shared_pool("index", READERS).map(backend.read_bytes, keys))


def _on_base(backend, cached: Loaded | None, objects: dict[str, int], mark: bytes | None, now: float) -> Any:
    """The index of a listing that holds one base and operations: the base taken as it is stored
    (the main layer, no rebuild), its artifacts removed since hidden, and the adds it lacks in the
    recent layer. A listing holds the whole index, so what ``cached`` read before is not needed,
    but its adds are reused rather than read again. None when the listing is of another shape
    (several bases) or would not make layers (see :func:`_with_recent`): the caller builds the
    whole trie."""
    bases = [k for k in objects if k.startswith(BASES)]
    adds = sorted(k for k in objects if k.startswith(OPS) and k.endswith(".add"))
    dels = sorted(k for k in objects if k.startswith(OPS) and k.endswith(".del"))
    if len(bases) != 1 or len(bases) + len(adds) + len(dels) != len(objects):
        return None
    data = backend.read_bytes(bases[0])
    if data is None:
        return _VANISHED
    meta, arrays = _unpack(bases[0], BASE_MAGIC, data)
    main = _Trie.from_base(bases[0], meta, arrays)
    dead = meta.get("dead")
    if not isinstance(dead, list) or not all(isinstance(d, str) for d in dead):
        raise IndexCorrupt(f"index object '{bases[0]}' is corrupted (cancelled ids); rebuild the index")
    state = _State(
        main.declared_chunk_tokens, {a.id: a for a in main.arts}, set(dead), {r["root"]: r for r in main.root_meta}
    )
    read = len(data)
    for key, blob in zip(dels, _read_each(backend, dels)):  # removes first: an add they cancel stays out
        if blob is None:
            return _VANISHED
        read += len(blob)
        state.merge_object(key, blob)
    hidden = frozenset(rank for rank, a in enumerate(main.arts) if a.id not in state.arts) if dels else frozenset()
    held = state.arts.keys() | state.dead  # an add folded into the base may still be listed
    reusable: dict[str, _Art] = {}
    if cached is not None:  # arts read from operations (an artifact of a lazily taken base has no edges)
        added = cached.recent_ids | cached.newest_ids
        reusable = {i: cached.state.arts[i] for i in added} if cached.lazy else cached.state.arts
    recent_ids, unread = set(), []
    for key in adds:
        op_id = key[len(OPS) : -len(".add")]
        if op_id in held:
            continue
        art = reusable.get(op_id)
        if art is not None and cached is not None and cached.state.chunk_tokens is not None:
            state._chunk(key, cached.state.chunk_tokens)
            state.arts[op_id] = art
            state.roots.setdefault(art.root, cached.state.roots[art.root])
            recent_ids.add(op_id)
        else:
            unread.append(key)
    for key, blob in zip(unread, _read_each(backend, unread)):
        if blob is None:
            return _VANISHED
        read += len(blob)
        state.merge_object(key, blob)
        op_id = key[len(OPS) : -len(".add")]
        if op_id in state.arts:
            recent_ids.add(op_id)
    names = {state.arts[i].name for i in recent_ids}
    if len(recent_ids) > RECENT_MAX or len(hidden) > HIDDEN_MAX or _answers_for(main, hidden, names):
        return None
    recent = _layer(state, recent_ids) if recent_ids else None
    read += cached.bytes_read if cached is not None else 0
    lazy = (bases[0], data)
    return Loaded(set(objects), state, main, read, lazy, mark, now, recent, frozenset(recent_ids), hidden=hidden)


def _with_recent(
    cached: Loaded, got: list[tuple[str, bytes]], read: int, mark: bytes | None, listed_at: float
) -> Loaded | None:
    """``cached`` with the operations ``got``: adds join its newest layer (merged into the recent
    one past :data:`NEWEST_MAX`, or when a name repeats there: one trie keeps the newer); removes
    hide the main layer's artifacts and rebuild the small layers they touch. None when that would
    not be the index: a base among them, a name the main layer answers for (the newer must replace
    it), more adds than :data:`RECENT_MAX` or more removed than :data:`HIDDEN_MAX`."""
    if any(key.startswith(BASES) for key, _ in got):
        return None
    old = cached.state
    state = _State(old.chunk_tokens, dict(old.arts), set(old.dead), dict(old.roots))
    for key, data in got:
        state.merge_object(key, data)
    hiding: set[int] = set()
    gone: AbstractSet[str] = set()
    if any(key.endswith(".del") for key, _ in got):  # sets the size of the store: only then
        gone = old.arts.keys() - state.arts.keys()
        rank_of = cached.main.rank_of
        hiding = {rank_of[op_id] for op_id in gone if op_id in rank_of} - cached.hidden
    hidden = cached.hidden | hiding
    added = {key[len(OPS) : -len(".add")] for key, _ in got if key.endswith(".add")} & state.arts.keys()
    if hiding:  # an older add of a hidden name, still live, is the index's answer for it: rebuild
        names = {cached.main.arts[rank].name for rank in hiding}
        if any(art.name in names and op_id not in added for op_id, art in state.arts.items()):
            return None
    kept = (cached.recent_ids | cached.newest_ids) - gone
    if len(kept) + len(added) > RECENT_MAX or len(hidden) > HIDDEN_MAX:
        return None
    names = {state.arts[op_id].name for op_id in added}
    if _answers_for(cached.main, hidden, names):
        return None
    recent_ids, newest_ids = cached.recent_ids - gone, (cached.newest_ids - gone) | added
    recent = cached.recent if recent_ids == cached.recent_ids else _layer(state, recent_ids) if recent_ids else None
    if names & {state.arts[op_id].name for op_id in kept} or len(newest_ids) > NEWEST_MAX:
        recent_ids, newest_ids = recent_ids | newest_ids, frozenset()
        recent = _layer(state, recent_ids)
    newest = cached.newest if newest_ids == cached.newest_ids else _layer(state, newest_ids) if newest_ids else None
    seen = cached.seen | {key for key, _ in got}
    return dataclasses.replace(
        cached,
        seen=seen,
        state=state,
        bytes_read=read,
        mark=mark,
        listed_at=listed_at,
        recent=recent,
        recent_ids=frozenset(recent_ids),
        newest=newest,
        newest_ids=frozenset(newest_ids),
        hidden=frozenset(hidden),
    )


def _answers_for(main: _Trie, hidden: AbstractSet[int], names: set[str]) -> bool:
    """Whether ``main`` answers for any of ``names`` (holds it, not hidden): then a newer add of
    it must replace it there, and the whole trie is built."""
    hidden_names = {main.arts[rank].name for rank in hidden}
    return any(name not in hidden_names for name in names & main.names)


def _layer(state: _State, ids: Iterable[str]) -> _Trie:
    """A trie of the artifacts ``ids`` of ``state`` alone (a recent layer)."""
    return _Trie(_State(state.chunk_tokens, {op_id: state.arts[op_id] for op_id in ids}, set(), dict(state.roots)))


def _clock() -> float:
    """Seconds, for :data:`RELIST_S` (tests replace it)."""
    return time.monotonic()


def _keep(backend, loaded: Loaded) -> None:
    with _LOCK:
        _CACHE[backend] = loaded


def lookup(
    backend,
    root: str,
    query_ids: Sequence[int] | np.ndarray,
    start_tokens: int = 0,
    limit: int = 10,
    refresh: bool = True,
) -> list[Hit]:
    """Artifacts of ``root`` sharing the longest prefix with the query, best first (rank's order).

    Returns the any-prefix artifacts sharing the longest prefix (up to ``limit``, fewest tokens
    first) and every whole-prefix artifact the query contains whole. A prefix counts only past
    ``start_tokens`` (the tokenizer's own start tokens are no match).
    """
    hits = load(backend, refresh).lookup(root, _check_ids(query_ids), start_tokens, max(1, limit))
    hits.sort(key=Hit.sort_key)
    return hits[:limit]


def from_matches(matches: Iterable[Any], root: str, query_ids, start_tokens: int, limit: int) -> list[Hit]:
    """The hits of a remote lookup's matches (the hosted ``/prefix/lookup``), as :func:`lookup` gives
    them: a chunk-granular match refined to the token by its ``next_tokens``, a whole-prefix
    candidate kept only when the query's own key at its length is its ``end_key``; then only the
    any-prefix artifacts sharing the longest prefix, and every whole-prefix one held whole."""
    q = _check_ids(query_ids)
    c = chainkeys.CHUNK_TOKENS
    full = chainkeys.full_chain(root, q, c)
    anyp, whole = [], []
    for m in matches:
        prefix, count = int(m.matched_tokens), int(m.token_count)
        if m.reuse == WHOLE_PREFIX:
            if not m.exact:
                depth = prefix // c
                parent = full[depth - 1] if depth else root
                if count > q.size or chainkeys.child_key(parent, q[depth * c : count]) != m.end_key:
                    continue
                prefix = count
            if prefix == count and count > start_tokens:
                whole.append((m, prefix))
            continue
        if not m.exact and m.next_tokens:
            prefix += _lcp(np.asarray(m.next_tokens, dtype=np.int64), q[prefix : prefix + c])
        if prefix > start_tokens:
            anyp.append((m, prefix))
    best = max((p for _, p in anyp), default=0)
    hits = [
        Hit(
            m.name,
            root,
            p,
            usable(p, int(m.token_count), q.size, m.reuse),
            int(m.token_count),
            m.reuse,
            m.compute_dtype,
            m.quantization,
            m.artifact_id,
        )
        for m, p in [*(x for x in anyp if x[1] == best), *whole]
    ]
    hits.sort(key=Hit.sort_key)
    return hits[:limit]


def roots(backend, refresh: bool = True) -> list[dict]:
    """The roots in the index, each with the model, compute dtype and quantization that made it."""
    return load(backend, refresh).root_meta()


def compact(backend, now: Callable[[], int] = time.time_ns) -> str:
    """Fold every index object read into one new base, then delete those objects. Returns its key."""
    loaded = load(backend)
    trie = loaded.trie
    key = f"{BASES}{int(now()):020d}-{uuid.uuid4().hex}.kvix"
    backend.write_bytes(key, trie.to_base(loaded.state.dead))
    for old in sorted(loaded.seen):
        backend.delete(old)
    _changed(backend)
    with _LOCK:
        if trie.superseded:  # cancelled in the base, live in the cached state: read the base afresh
            _CACHE.pop(backend, None)
        elif _CACHE.get(backend) is loaded:
            _CACHE[backend] = dataclasses.replace(loaded, seen={key})
    return key


def rebuild(backend, artifacts: Iterable[tuple[Any, Sequence[int]]]) -> int:
    """Replace the index with one built from ``artifacts``, (record, token ids) pairs: the chunk
    store's records (:meth:`ChunkStore.rebuild_index`), after a crash or a damaged index.

    Objects written while it runs survive (only those listed first are deleted). Returns the count.
    """
    stale = list(_index_objects(backend))
    state = _State()
    at = time.time_ns()
    for record, token_ids in artifacts:
        ids = _check_ids(token_ids)
        op_id = uuid.uuid4().hex
        chunk_tokens = state._chunk("rebuild", int(getattr(record, "chunk_tokens", chainkeys.CHUNK_TOKENS)))
        state.roots.setdefault(str(record.root), {"root": str(record.root), **_describe(record)})
        state.arts[op_id] = _art_from_ids(
            op_id, str(record.name), str(record.root), str(record.reuse), at, ids, chunk_tokens
        )
    trie = _Trie(state)
    key = f"{BASES}{at:020d}-{uuid.uuid4().hex}.kvix"
    backend.write_bytes(key, trie.to_base(()))
    for old in stale:
        backend.delete(old)
    _changed(backend)
    with _LOCK:
        _CACHE.pop(backend, None)
    return len(trie.arts)


def stats(backend) -> dict[str, int]:
    """Sizes for reports: artifacts, nodes, index bytes in the store and in memory."""
    trie = load(backend).trie
    stored = sum(_index_objects(backend).values())
    return {
        "artifacts": len(trie.arts),
        "nodes": int(trie.node_key.size),
        "stored_bytes": stored,
        "memory_bytes": int(trie.nbytes),
    }
