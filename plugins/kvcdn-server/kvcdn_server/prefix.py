"""The hosted prefix index: which confirmed artifacts a caller may see share the longest prefix with
a query, answered in one request from the query's chain keys (:mod:`kvcdn_core.store.keys`).

Every confirmed artifact is indexed in the confirm's own transaction and dropped in the delete's
(and a replacing confirm's), so the index never disagrees with the artifacts table. Rows are kept
per *scope*: the owning tenant for a private artifact, :data:`PUBLIC` for a published one. A lookup
reads only the caller's scope and the public scope, so a key held only in another tenant's private
artifact is, physically, the same path through the same index as a key nobody holds. Keys are
stored as their 32 raw bytes.

- ``prefix_nodes``: one row per (scope, node, artifact). An any-prefix artifact has a ``path`` row
  at each chain key of its tokens (the root, each full chunk, then its last partial chunk); a
  whole-prefix artifact (state layers: its cache cannot be cut) has one ``end`` row at the key of
  its whole chunks, and a query finds it only when the query contains it whole (docs/store-index.md's
  rule). The primary key orders rows of one node by (token count, name): the best artifacts of a
  node (fewest tokens, then name) are the first rows of a seek.
- ``prefix_children``: the edges of the chunk tree, one row per (scope, parent, child) with how
  many artifacts pass along it and the key of the child's first 16 tokens (empty when it holds
  fewer): a lookup lists the children of the deepest node it matched, those that share the query's
  next 16 tokens when any does, so the client can refine the match to the token among them.
- ``prefix_heads``: for the children of a *wide* node (at least :data:`HEADS_FROM` children in a
  scope), the keys of each child's first 1 to 15 tokens (:func:`heads_of`): a query that shares
  fewer than 16 tokens with all of a wide node's children finds those sharing the most with it,
  however many children the node has.
- ``prefix_artifacts``: what a match shows (name, token count, reuse rule, dtype, quantization) and
  the token ids that refinement reads.
- ``prefix_roots``: the roots (model fingerprint, representation) of each scope with how many
  artifacts use them, so a client can learn which roots exist for it without any scan.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa

from kvcdn_core.artifact import Header
from kvcdn_core.artifact.manifest import ANY_PREFIX, manifest_of
from kvcdn_core.store import keys as chainkeys
from kvcdn_core.store.pack import root_of
from kvcdn_server.db import metadata

#: the scope of published artifacts (no tenant id is empty)
PUBLIC = ""
PATH, END = "path", "end"
#: children of one node a lookup refines among, per scope (more: the answer says ``complete: false``)
MAX_CHILDREN = 32
#: children from which a node's edges get head rows: below :data:`MAX_CHILDREN`, so a node that
#: grows past it had head rows written by the confirms that took it from here to there, however
#: they interleave (each such confirm writes those of every child it sees)
HEADS_FROM = MAX_CHILDREN // 2 + 1

prefix_nodes = sa.Table(
    "prefix_nodes",
    metadata,
    sa.Column("scope", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(8), nullable=False),
    sa.Column("node_key", sa.LargeBinary(32), nullable=False),
    sa.Column("token_count", sa.BigInteger, nullable=False),
    sa.Column("name", sa.String(1024), nullable=False),
    sa.Column("artifact_id", sa.String(36), nullable=False),
    sa.PrimaryKeyConstraint("scope", "kind", "node_key", "token_count", "name", "artifact_id"),
    sa.Index("ix_prefix_nodes_artifact", "artifact_id"),
)

prefix_children = sa.Table(
    "prefix_children",
    metadata,
    sa.Column("scope", sa.String(255), nullable=False),
    sa.Column("parent_key", sa.LargeBinary(32), nullable=False),
    sa.Column("block_key", sa.LargeBinary(32), nullable=False),
    sa.Column("child_key", sa.LargeBinary(32), nullable=False),
    sa.Column("artifacts", sa.BigInteger, nullable=False),
    sa.PrimaryKeyConstraint("scope", "parent_key", "block_key", "child_key"),
)

prefix_heads = sa.Table(
    "prefix_heads",
    metadata,
    sa.Column("scope", sa.String(255), nullable=False),
    #: the key of a child's first 1..15 tokens after its parent (it hashes the parent's key)
    sa.Column("head_key", sa.LargeBinary(32), nullable=False),
    sa.Column("child_key", sa.LargeBinary(32), nullable=False),
    sa.PrimaryKeyConstraint("scope", "head_key", "child_key"),
)

prefix_artifacts = sa.Table(
    "prefix_artifacts",
    metadata,
    sa.Column("artifact_id", sa.String(36), primary_key=True),
    sa.Column("scope", sa.String(255), nullable=False),
    sa.Column("root", sa.String(64), nullable=False),
    sa.Column("name", sa.String(1024), nullable=False),
    sa.Column("token_count", sa.BigInteger, nullable=False),
    sa.Column("reuse", sa.String(16), nullable=False),
    sa.Column("compute_dtype", sa.String(32)),
    sa.Column("quantization", sa.String(64)),
    sa.Column("end_key", sa.String(64), nullable=False),
    #: its token ids (little-endian uint32): the next chunk of a chunk-granular match is sent back
    #: to the caller, who may read the artifact anyway, to refine the match to the token
    sa.Column("token_ids", sa.LargeBinary, nullable=False),
)

prefix_roots = sa.Table(
    "prefix_roots",
    metadata,
    sa.Column("scope", sa.String(255), nullable=False),
    sa.Column("root", sa.String(64), nullable=False),
    sa.Column("artifacts", sa.BigInteger, nullable=False),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("compute_dtype", sa.String(32)),
    sa.Column("quantization", sa.String(64)),
    sa.PrimaryKeyConstraint("scope", "root"),
)


def scope_of(tenant: str, visibility: str) -> str:
    return PUBLIC if visibility == "public" else tenant


@dataclasses.dataclass(frozen=True)
class Entry:
    """What the index keeps of one artifact, computed from its header and token ids at confirm."""

    root: str
    reuse: str
    token_count: int
    model: dict[str, Any]
    compute_dtype: str | None
    quantization: str | None
    keys: list[str]  # path keys (any-prefix: the root, then each chunk), or the one anchor key (whole-prefix)
    end_key: str  # the key of all its tokens
    token_ids: bytes  # little-endian uint32
    #: any-prefix: (parent, the key of the chunk's first 16 tokens or b"", child) of each chunk
    edges: list[tuple[bytes, bytes, bytes]]


def entry_of(header: Header, token_ids: Sequence[int]) -> Entry:
    """The index entry of a checked artifact: its root and chain keys, as a chunk store computes them."""
    manifest = manifest_of(header)
    rep = (manifest.compute_dtype, manifest.scheme)
    return entry_from_ids(root_of(manifest), manifest.reuse, token_ids, dataclasses.asdict(manifest.model), *rep)


def entry_from_ids(
    root: str, reuse: str, token_ids: Sequence[int] | np.ndarray, model: dict, compute_dtype, quantization
) -> Entry:
    """The entry of an artifact of ``token_ids`` under ``root`` (also what the benchmark indexes)."""
    c = chainkeys.CHUNK_TOKENS
    ids = np.asarray(token_ids, dtype=np.int64)
    chain = chainkeys.chain(root, ids)
    whole = ids.size // c
    keys = [root, *chain] if reuse == ANY_PREFIX else [chain[whole - 1] if whole else root]
    end_key = chain[-1] if chain else root
    edges = []
    if reuse == ANY_PREFIX:
        for i, (parent, child) in enumerate(zip(keys[:-1], keys[1:])):
            block = chainkeys.first_block(parent, ids[i * c : (i + 1) * c])
            edges.append((bytes.fromhex(parent), bytes.fromhex(block) if block else b"", bytes.fromhex(child)))
    raw = ids.astype("<u4").tobytes()
    return Entry(root, reuse, int(ids.size), model, compute_dtype, quantization, keys, end_key, raw, edges)


def heads_of(parent: bytes, chunk_ids) -> list[bytes]:
    """The keys of a chunk's first 1, 2, ... 15 ids after ``parent`` (fewer when it holds fewer):
    what a query sharing under 16 tokens with a wide node's children is matched by."""
    return chainkeys.heads(parent, chunk_ids)


def _edge_ids(entry: Entry, i: int) -> np.ndarray:
    """Edge ``i``'s child chunk's token ids (the artifact's chunk ``i``)."""
    c = chainkeys.CHUNK_TOKENS
    return np.frombuffer(entry.token_ids, dtype="<u4")[i * c : (i + 1) * c]


def index_artifact(conn, artifact_id: str, scope: str, name: str, entry: Entry) -> None:
    """Index a confirmed artifact; called inside the confirm's transaction."""
    index_artifacts(conn, [(artifact_id, scope, name, entry)])


def index_artifacts(conn, items: Sequence[tuple[str, str, str, Entry]]) -> None:
    """Index several artifacts, each ``(artifact_id, scope, name, entry)``, in a few statements (a
    confirm indexes one; a bulk load, such as the benchmark's, many)."""
    nodes, arts = [], []
    edges: collections.Counter = collections.Counter()
    roots: dict[tuple[str, str], list] = {}
    for artifact_id, scope, name, entry in items:
        kind = PATH if entry.reuse == ANY_PREFIX else END
        row = {"scope": scope, "token_count": entry.token_count, "name": name, "artifact_id": artifact_id}
        nodes += [{**row, "kind": kind, "node_key": bytes.fromhex(key)} for key in entry.keys]
        edges.update((scope, *edge) for edge in entry.edges)
        arts.append(
            {
                **row,
                "root": entry.root,
                "reuse": entry.reuse,
                "compute_dtype": entry.compute_dtype,
                "quantization": entry.quantization,
                "end_key": entry.end_key,
                "token_ids": entry.token_ids,
            }
        )
        roots.setdefault((scope, entry.root), [entry, 0])[1] += 1
    if nodes:
        conn.execute(prefix_nodes.insert(), nodes)
    _add_edges(conn, edges)
    _add_heads(conn, [(scope, entry) for _, scope, _, entry in items])
    if arts:
        conn.execute(prefix_artifacts.insert(), arts)
    insert = _upsert(conn)(prefix_roots)
    for (scope, root), (entry, count) in roots.items():
        values = insert.values(
            scope=scope,
            root=root,
            artifacts=count,
            model=json.dumps(entry.model, sort_keys=True),
            compute_dtype=entry.compute_dtype,
            quantization=entry.quantization,
        )
        conn.execute(
            values.on_conflict_do_update(
                index_elements=["scope", "root"], set_={"artifacts": prefix_roots.c.artifacts + count}
            )
        )


def _add_edges(conn, counts: collections.Counter) -> None:
    """Add to each edge ``(scope, parent, block, child)`` its count of new artifacts passing it."""
    if not counts:
        return
    insert = _upsert(conn)(prefix_children)
    statement = insert.on_conflict_do_update(
        index_elements=["scope", "parent_key", "block_key", "child_key"],
        set_={"artifacts": prefix_children.c.artifacts + insert.excluded.artifacts},
    )
    rows = [
        {"scope": s, "parent_key": p, "block_key": b, "child_key": k, "artifacts": n}
        for (s, p, b, k), n in counts.items()
    ]
    conn.execute(statement, rows)


def _add_heads(conn, entries: list[tuple[str, Entry]]) -> None:
    """Head rows for the new artifacts' edges out of wide nodes; and, for a node this batch finds
    between :data:`HEADS_FROM` and :data:`MAX_CHILDREN` children, for all its children (written
    again: rows already there are kept)."""
    by_parent: dict[tuple[str, bytes], dict[bytes, np.ndarray]] = {}  # (scope, parent) -> child -> ids
    depth_of: dict[tuple[str, bytes], int] = {}
    for scope, entry in entries:
        for i, (parent, _block, child) in enumerate(entry.edges):
            by_parent.setdefault((scope, parent), {})[child] = _edge_ids(entry, i)
            depth_of[(scope, parent)] = i
    counts = _count_children(conn, list(by_parent))
    rows = []
    for (scope, parent), children in by_parent.items():
        count = counts.get((scope, parent), 0)
        if count < HEADS_FROM:
            continue
        if count <= MAX_CHILDREN:
            children = {**_children_ids(conn, scope, parent, depth_of[(scope, parent)]), **children}
        for child, ids in children.items():
            rows += [{"scope": scope, "head_key": h, "child_key": child} for h in heads_of(parent, ids)]
    if rows:
        insert = _upsert(conn)(prefix_heads)
        conn.execute(insert.on_conflict_do_nothing(index_elements=["scope", "head_key", "child_key"]), rows)


def _count_children(conn, parents: list[tuple[str, bytes]]) -> dict[tuple[str, bytes], int]:
    """How many children each ``(scope, parent)`` has, counted up to ``MAX_CHILDREN + 1`` (a seek
    of at most that many index entries each; 200 parents a statement)."""
    counts = {}
    for first in range(0, len(parents), 200):
        params: dict[str, Any] = {"cap": MAX_CHILDREN + 1}
        arms = []
        for i, (scope, parent) in enumerate(parents[first : first + 200]):
            params[f"s{i}"], params[f"p{i}"] = scope, parent
            arms.append(
                f"SELECT {i} AS i, count(*) AS n FROM (SELECT 1 FROM prefix_children "
                f"WHERE scope = :s{i} AND parent_key = :p{i} LIMIT :cap) AS c{i}"
            )
        for r in conn.execute(sa.text(" UNION ALL ".join(arms)), params):
            counts[parents[first + r.i]] = r.n
    return counts


def _children_ids(conn, scope: str, parent: bytes, depth: int) -> dict[bytes, np.ndarray]:
    """Each child of ``parent`` (a node at chunk ``depth``), with its first 15 token ids read from
    one artifact through it: the few reads of a node crossing :data:`HEADS_FROM`."""
    c = chainkeys.CHUNK_TOKENS
    e, n, a = prefix_children.c, prefix_nodes.c, prefix_artifacts.c
    found = {}
    for (child,) in conn.execute(sa.select(e.child_key).where(e.scope == scope, e.parent_key == parent)):
        through = (
            sa.select(n.artifact_id)
            .where(n.scope == scope, n.kind == PATH, n.node_key == child)
            .limit(1)
            .scalar_subquery()
        )
        piece = sa.func.substr(a.token_ids, depth * c * 4 + 1, (chainkeys.BLOCK_TOKENS - 1) * 4)
        raw = conn.execute(sa.select(piece).where(a.artifact_id == through)).scalar()
        if raw is not None:
            found[bytes(child)] = np.frombuffer(bytes(raw), dtype="<u4")
    return found


def _drop_edges(conn, scope: str, edges: list[tuple[bytes, bytes, bytes]]) -> None:
    """Take one artifact off each of its edges, deleting those it was the last to pass."""
    if not edges:
        return
    e = prefix_children.c
    where = sa.and_(
        e.scope == sa.bindparam("s"),
        e.parent_key == sa.bindparam("p"),
        e.block_key == sa.bindparam("b"),
        e.child_key == sa.bindparam("k"),
    )
    params = [{"s": scope, "p": p, "b": b, "k": k} for p, b, k in edges]
    conn.execute(prefix_children.update().where(where).values(artifacts=e.artifacts - 1), params)
    conn.execute(prefix_children.delete().where(where, e.artifacts <= 0), params)


def _drop_heads(conn, scope: str, entry: Entry) -> None:
    """Delete the head rows of ``entry``'s edges that are gone (after :func:`_drop_edges`): first
    which of its edges have any (their one-token head), then only theirs."""
    e, h = prefix_children.c, prefix_heads.c
    firsts = {}
    for i, (p, _b, k) in enumerate(entry.edges):
        ids = _edge_ids(entry, i)
        if ids.size:
            firsts[(chainkeys.heads(p, ids[:1])[0], k)] = i
    if not firsts:
        return
    has = conn.execute(
        sa.select(h.head_key, h.child_key).where(h.scope == scope, h.head_key.in_([f for f, _ in firsts]))
    ).all()
    edges = sorted(
        {
            firsts[(bytes(r.head_key), bytes(r.child_key))]
            for r in has
            if (bytes(r.head_key), bytes(r.child_key)) in firsts
        }
    )
    if not edges:
        return
    edge = sa.exists().where(
        e.scope == sa.bindparam("s"),
        e.parent_key == sa.bindparam("p"),
        e.block_key == sa.bindparam("b"),
        e.child_key == sa.bindparam("k"),
    )
    params = []
    for i in edges:
        p, b, k = entry.edges[i]
        params += [{"s": scope, "p": p, "b": b, "k": k, "h": head} for head in heads_of(p, _edge_ids(entry, i))]
    where = sa.and_(h.scope == sa.bindparam("s"), h.head_key == sa.bindparam("h"), h.child_key == sa.bindparam("k"))
    conn.execute(prefix_heads.delete().where(where, ~edge), params)


def _upsert(conn):
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def drop_artifact(conn, artifact_id: str) -> None:
    """Remove an artifact from the index (nothing when it was never indexed); called inside the
    transaction that deletes or replaces it."""
    a = prefix_artifacts.c
    row = conn.execute(sa.select(a.scope, a.root, a.reuse, a.token_ids).where(a.artifact_id == artifact_id)).first()
    if row is None:
        return
    ids = np.frombuffer(row.token_ids, dtype="<u4")
    entry = entry_from_ids(row.root, row.reuse, ids, {}, None, None)
    conn.execute(prefix_nodes.delete().where(prefix_nodes.c.artifact_id == artifact_id))
    _drop_edges(conn, row.scope, entry.edges)
    _drop_heads(conn, row.scope, entry)
    conn.execute(prefix_artifacts.delete().where(a.artifact_id == artifact_id))
    where = sa.and_(prefix_roots.c.scope == row.scope, prefix_roots.c.root == row.root)
    conn.execute(prefix_roots.update().where(where).values(artifacts=prefix_roots.c.artifacts - 1))
    conn.execute(prefix_roots.delete().where(where, prefix_roots.c.artifacts <= 0))


# -- reading -----------------------------------------------------------------------------------------


def roots(conn, tenant: str) -> list[dict[str, Any]]:
    """The roots the caller can find artifacts under (its own and the public ones), one entry each."""
    rows = conn.execute(
        sa.select(prefix_roots)
        .where(prefix_roots.c.scope.in_((tenant, PUBLIC)))
        .order_by(prefix_roots.c.root, prefix_roots.c.scope)
    ).all()
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        found = seen.setdefault(
            r.root,
            {
                "root": r.root,
                "model": json.loads(r.model),
                "compute_dtype": r.compute_dtype,
                "quantization": r.quantization,
                "artifacts": 0,
            },
        )
        found["artifacts"] += r.artifacts
    return list(seen.values())


def _probe_statement(raw: list[bytes], scopes: tuple[str, ...]):
    """The first statement of a lookup, as SQL text: built by string joins, because compiling an
    expression of hundreds of VALUES rows took most of a lookup's time. ``q(pos, k)`` holds the
    keys: ``-1`` the root, ``0 ..`` the query's full chunks. It finds which full-chunk keys some
    any-prefix artifact passes through, and the whole-prefix artifacts anchored on any key. Every
    probe compares scope, kind and node_key for equality: a seek on the primary key."""
    values = ", ".join(f"(:p{i}, :k{i})" for i in range(len(raw)))
    params: dict[str, Any] = {}
    for i, key in enumerate(raw):
        params[f"p{i}"], params[f"k{i}"] = i - 1, key
    exists, joins = [], []
    for j, scope in enumerate(scopes):
        params[f"s{j}"] = scope
        exists.append(
            f"EXISTS (SELECT 1 FROM prefix_nodes n WHERE n.scope = :s{j} AND n.kind = '{PATH}' AND n.node_key = q.k)"
        )
        joins.append(
            f"SELECT q.pos AS pos, n.kind AS kind, n.artifact_id AS id FROM q "
            f"JOIN prefix_nodes n ON n.scope = :s{j} AND n.kind = '{END}' AND n.node_key = q.k"
        )
    present = f"SELECT q.pos AS pos, NULL AS kind, NULL AS id FROM q WHERE q.pos >= 0 AND ({' OR '.join(exists)})"
    sql = f"WITH q(pos, k) AS (VALUES {values}) " + " UNION ALL ".join([present, *joins])
    return sa.text(sql), params


def _union(arms: list[str]) -> str:
    """Arms that each order and limit their own rows, as one statement (SQLite wants them wrapped)."""
    return " UNION ALL ".join(f"SELECT * FROM ({arm}) AS a{i}" for i, arm in enumerate(arms))


def _children(
    conn, scopes: tuple[str, ...], node: bytes, block: bytes | None
) -> tuple[list[tuple[str, bytes]], set[str], bool]:
    """The children of ``node`` a lookup refines among: those whose first 16 tokens have the key
    ``block`` (the query's next 16) when any has, since they share more of the query than any
    other; else every child. At most :data:`MAX_CHILDREN` per scope, in key order (no child is
    preferred). Also the scopes that had more, and whether the children listed share ``block``.
    One statement."""
    params: dict[str, Any] = {"node": node, "block": block or b"", "cap": MAX_CHILDREN + 1}
    arms = []
    for j, scope in enumerate(scopes):
        params[f"s{j}"] = scope
        where = f"FROM prefix_children WHERE scope = :s{j} AND parent_key = :node"
        arms.append(f"SELECT 0 AS any_block, scope, child_key {where} ORDER BY block_key, child_key LIMIT :cap")
        if block:
            arms.append(
                f"SELECT 1 AS any_block, scope, child_key {where} AND block_key = :block ORDER BY child_key LIMIT :cap"
            )
    rows = conn.execute(sa.text(_union(arms)), params).all()
    sharing = [r for r in rows if r.any_block]
    chosen = sharing or [r for r in rows if not r.any_block]
    found: dict[str, list[bytes]] = {scope: [] for scope in scopes}
    for r in chosen:
        found[r.scope].append(r.child_key)
    over = {scope for scope, keys in found.items() if len(keys) > MAX_CHILDREN}
    return [(scope, key) for scope in scopes for key in found[scope][:MAX_CHILDREN]], over, bool(sharing)


def _children_by_heads(conn, scopes: set[str], heads: list[bytes]) -> list[tuple[str, bytes]]:
    """The children of a wide node sharing the most of the query's first 15 tokens after it:
    ``heads[i]`` is the key of its first ``i + 1`` (:func:`heads_of`). Those at the longest head
    any child has, up to :data:`MAX_CHILDREN` per scope: they all share exactly that many tokens
    (one sharing more would have the next head), so any of them is a longest match. One statement."""
    params: dict[str, Any] = {"cap": MAX_CHILDREN}
    arms = []
    for j, scope in enumerate(sorted(scopes)):
        params[f"s{j}"] = scope
        for i, head in enumerate(heads):
            params[f"h{i}"] = head
            arms.append(
                f"SELECT {i} AS len, scope, child_key FROM prefix_heads "
                f"WHERE scope = :s{j} AND head_key = :h{i} ORDER BY child_key LIMIT :cap"
            )
    rows = conn.execute(sa.text(_union(arms)), params).all() if arms else []
    longest = max((r.len for r in rows), default=None)
    return [(r.scope, bytes(r.child_key)) for r in rows if r.len == longest]


def _best(conn, nodes: list[tuple[str, bytes]], limit: int) -> list[str]:
    """The ``limit`` best any-prefix artifacts (fewest tokens, then name) through each (scope, node):
    one seek on the primary key per node, in one statement."""
    params: dict[str, Any] = {"limit": limit}
    arms = []
    for i, (scope, key) in enumerate(nodes):
        params[f"s{i}"], params[f"k{i}"] = scope, key
        arms.append(
            f"SELECT artifact_id FROM prefix_nodes WHERE scope = :s{i} AND kind = '{PATH}' AND node_key = :k{i} "
            "ORDER BY token_count, name, artifact_id LIMIT :limit"
        )
    return [r.artifact_id for r in conn.execute(sa.text(_union(arms)), params)] if arms else []


def lookup(
    conn,
    tenant: str,
    root: str,
    keys: list[str],
    blocks: list[str],
    limit: int,
    steps: list[bytes] | None = None,
    heads: tuple[int, list[bytes]] | None = None,
) -> dict[str, Any]:
    """The longest match among the artifacts ``tenant`` may see (its own and published ones), in
    one request: ``keys`` are the chain keys of the query's full chunks, never its token ids, and
    ``blocks[i]`` the key of the first 16 tokens of its chunk ``i`` (after the root, then after each
    full chunk) where it has them.

    Four statements, whatever the store holds: the first seeks each key in the two scopes (does
    any artifact pass through it; which whole-prefix artifacts are anchored on it), giving the
    deepest node the query reaches; the second lists that node's children (those sharing the
    query's next 16 tokens when any does; up to :data:`MAX_CHILDREN` per scope); the third seeks
    the ``limit`` best artifacts through the node and through each child; the fourth reads those
    artifacts, with their token ids in the chunk after the node only.

    A match counts whole chunks; one that goes on past the node carries ``next_chunk``, an index
    into ``next_chunks``: its token ids in the next chunk (the caller may read the artifact), from
    which the client finds the exact length, the longest among all the node's children. A
    whole-prefix artifact that does not end on a chunk boundary comes back with its ``end_key``
    (the key of all its tokens), which the client compares with the key of its own tokens there.

    With ``steps`` (the query's 4-byte key prefixes per 16 tokens of each chunk, or ``[]``), the
    answer also names in ``best`` the match :func:`best_match` ranks first (for the route's grant).
    With ``heads``, ``(depth, keys)``: the keys of the query's first 1 to 15 tokens after its node
    at chunk ``depth`` (:func:`heads_of`), sent again by a client whose answer was incomplete: a
    scope with more children than one answer lists, none sharing the next 16 tokens, is then
    refined among those that share the most of them (``prefix_heads``), and the answer is complete.
    """
    scopes = (tenant, PUBLIC)
    c = chainkeys.CHUNK_TOKENS
    raw = [bytes.fromhex(root), *(bytes.fromhex(k) for k in keys)]
    found = conn.execute(*_probe_statement(raw, scopes)).all()
    present = {r.pos for r in found if r.kind is None}
    depth = 0
    while depth in present:  # keys chain: chunk i present means every chunk before it is
        depth += 1
    anchored = {r.id: r.pos + 1 for r in found if r.kind == END}  # whole-prefix id -> whole chunks before its rest
    block = bytes.fromhex(blocks[depth]) if depth < len(blocks) else None
    children, over, sharing = _children(conn, scopes, raw[depth], block)
    complete = not over
    if over and not sharing and heads is not None and heads[0] == depth and heads[1]:
        children = [child for child in children if child[0] not in over] + _children_by_heads(conn, over, heads[1])
        complete = True
    candidates = _best(conn, [(scope, raw[depth]) for scope in scopes] + children, limit)
    wanted = sorted({*candidates, *anchored})
    a = prefix_artifacts.c
    columns = [a.artifact_id, a.scope, a.root, a.name, a.token_count, a.reuse, a.compute_dtype, a.quantization]
    piece = sa.func.substr(a.token_ids, depth * c * 4 + 1, c * 4).label("next_ids")
    rows = conn.execute(sa.select(*columns, a.end_key, piece).where(a.artifact_id.in_(wanted))) if wanted else []
    matches: list[dict[str, Any]] = []
    chunks: dict[bytes, int] = {}  # a next chunk's bytes -> its index in next_chunks
    for r in rows:
        if r.root != root or r.scope not in scopes:
            continue
        match: dict[str, Any] = {
            "artifact_id": r.artifact_id,
            "name": r.name,
            "matched_tokens": depth * c,
            "exact": r.token_count == depth * c,
            "token_count": r.token_count,
            "reuse": r.reuse,
            "compute_dtype": r.compute_dtype,
            "quantization": r.quantization,
        }
        if r.artifact_id in anchored:
            whole = anchored[r.artifact_id]
            match["matched_tokens"], match["exact"] = whole * c, r.token_count == whole * c
            if not match["exact"]:
                match["end_key"] = r.end_key
        elif not match["exact"]:
            match["next_chunk"] = chunks.setdefault(bytes(r.next_ids), len(chunks))
        matches.append(match)
    matches.sort(key=lambda m: (m["token_count"], m["name"], m["artifact_id"]))
    best = None
    if steps is not None:
        query_steps = steps[depth] if depth < len(steps) else b""
        best = best_match(matches, list(chunks), raw[depth], query_steps)
    return {
        "root": root,
        "matched_chunks": depth,
        "chunk_tokens": c,
        "complete": complete,
        "next_chunks": [base64.b64encode(b).decode() for b in chunks],
        "matches": matches,
        "best": best,
    }


def best_match(matches: list[dict[str, Any]], next_chunks: list[bytes], node: bytes, query_steps: bytes) -> str | None:
    """The id of the match a client's refinement (:func:`kvcdn_core.store.index.from_matches`) most
    likely ranks first, without the query's tokens: each candidate's next chunk is ranked by how
    many of its 16-token steps have the query's key prefixes (``query_steps``), then fewest tokens
    and name, as the client ranks ties. A whole-prefix artifact counts only when it is exact (held
    whole, found by its anchor); one ending inside a chunk needs the query's tokens to check. The
    client checks what it gets: a wrong pick costs it one more request, never a wrong load."""
    step = chainkeys.STEP_BYTES
    shared: dict[int, int] = {}  # next chunk -> tokens of it whose steps the query shares

    def extra(index: int) -> int:
        if index not in shared:
            mine = chainkeys.steps(node, np.frombuffer(next_chunks[index], dtype="<u4"))
            n = 0
            while n * step < min(len(mine), len(query_steps)) and (
                mine[n * step : (n + 1) * step] == query_steps[n * step : (n + 1) * step]
            ):
                n += 1
            shared[index] = n * chainkeys.BLOCK_TOKENS
        return shared[index]

    ranked = []
    for m in matches:
        if m["reuse"] == ANY_PREFIX:
            tokens = m["matched_tokens"] + (extra(m["next_chunk"]) if "next_chunk" in m else 0)
        elif m["exact"]:
            tokens = m["token_count"]
        else:
            continue
        if tokens > 0:
            ranked.append((-tokens, m["token_count"], m["name"], m["artifact_id"]))
    return min(ranked)[3] if ranked else None
