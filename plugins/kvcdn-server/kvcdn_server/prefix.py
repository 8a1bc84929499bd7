"""The hosted prefix index: which confirmed artifacts a caller may see share the longest prefix with
a query, answered from chain keys (:mod:`kvcdn_core.store.keys`) by index seeks.

Every confirmed artifact is indexed in the confirm's own transaction and dropped in the delete's
(and a replacing confirm's), so the index never disagrees with the artifacts table. Rows are kept
per *scope*: the owning tenant for a private artifact, :data:`PUBLIC` for a published one. A lookup
reads only the caller's scope and the public scope, so a key held only in another tenant's private
artifact is, physically, the same path through the same index as a key nobody holds.

- ``prefix_nodes``: one row per (scope, node, artifact). An any-prefix artifact has a ``path`` row
  at each chain key of its tokens (each full chunk, then its last partial chunk); a whole-prefix
  artifact (state layers: its cache cannot be cut) has one ``end`` row at the key of all its tokens,
  and a query finds it only when the query contains it whole (docs/store-index.md's rule). The
  primary key orders rows of one node by (token count, name): the best artifact of a node (fewest
  tokens, then name) is the first row of a seek.
- ``prefix_artifacts``: what a match shows (name, token count, reuse rule, dtype, quantization).
- ``prefix_roots``: the roots (model fingerprint, representation) of each scope with how many
  artifacts use them, so a client can learn which roots exist for it without any scan.
"""

from __future__ import annotations

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
PATH, END, BLOCK = "path", "end", "block"

prefix_nodes = sa.Table(
    "prefix_nodes",
    metadata,
    sa.Column("scope", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(8), nullable=False),
    sa.Column("node_key", sa.String(64), nullable=False),
    sa.Column("token_count", sa.BigInteger, nullable=False),
    sa.Column("name", sa.String(1024), nullable=False),
    sa.Column("artifact_id", sa.String(36), nullable=False),
    sa.PrimaryKeyConstraint("scope", "kind", "node_key", "token_count", "name", "artifact_id"),
    sa.Index("ix_prefix_nodes_artifact", "artifact_id"),
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
    blocks: list[str]  # any-prefix: the keys of each chunk's first 16, 32, ... tokens
    end_key: str  # the key of all its tokens
    token_ids: bytes  # little-endian uint32


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
    keys, blocks = [chain[whole - 1] if whole else root], []
    if reuse == ANY_PREFIX:
        keys = [root, *chain]
        for i, parent in enumerate([root, *chain[:-1]]):
            blocks += chainkeys.block_keys(parent, ids[i * c : (i + 1) * c])
    end_key = chain[-1] if chain else root
    return Entry(
        root,
        reuse,
        int(ids.size),
        model,
        compute_dtype,
        quantization,
        keys,
        blocks,
        end_key,
        ids.astype("<u4").tobytes(),
    )


def index_artifact(conn, artifact_id: str, scope: str, name: str, entry: Entry) -> None:
    """Index a confirmed artifact; called inside the confirm's transaction."""
    kind = PATH if entry.reuse == ANY_PREFIX else END
    rows = [
        {
            "scope": scope,
            "kind": k,
            "node_key": key,
            "token_count": entry.token_count,
            "name": name,
            "artifact_id": artifact_id,
        }
        for k, keys in ((kind, entry.keys), (BLOCK, entry.blocks))
        for key in keys
    ]
    if rows:
        conn.execute(prefix_nodes.insert(), rows)
    conn.execute(
        prefix_artifacts.insert().values(
            artifact_id=artifact_id,
            scope=scope,
            root=entry.root,
            name=name,
            token_count=entry.token_count,
            reuse=entry.reuse,
            compute_dtype=entry.compute_dtype,
            quantization=entry.quantization,
            end_key=entry.end_key,
            token_ids=entry.token_ids,
        )
    )
    insert = _upsert(conn)(prefix_roots).values(
        scope=scope,
        root=entry.root,
        artifacts=1,
        model=json.dumps(entry.model, sort_keys=True),
        compute_dtype=entry.compute_dtype,
        quantization=entry.quantization,
    )
    conn.execute(
        insert.on_conflict_do_update(index_elements=["scope", "root"], set_={"artifacts": prefix_roots.c.artifacts + 1})
    )


def _upsert(conn):
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def drop_artifact(conn, artifact_id: str) -> None:
    """Remove an artifact from the index (nothing when it was never indexed); called inside the
    transaction that deletes or replaces it."""
    row = conn.execute(
        sa.select(prefix_artifacts.c.scope, prefix_artifacts.c.root).where(
            prefix_artifacts.c.artifact_id == artifact_id
        )
    ).first()
    if row is None:
        return
    conn.execute(prefix_nodes.delete().where(prefix_nodes.c.artifact_id == artifact_id))
    conn.execute(prefix_artifacts.delete().where(prefix_artifacts.c.artifact_id == artifact_id))
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


def _best(scopes: tuple[str, ...], key: str, limit: int, kind: str = PATH):
    """The ``limit`` best any-prefix rows of one node in each scope: seeks on the primary key."""
    n = prefix_nodes.c
    return sa.union_all(
        *(
            sa.select(
                sa.select(n.token_count, n.name, n.artifact_id)
                .where(n.scope == scope, n.kind == kind, n.node_key == key)
                .order_by(n.token_count, n.name, n.artifact_id)
                .limit(limit)
                .subquery()
            )
            for scope in scopes
        )
    )


def _probe_statement(probes: list[tuple[int, str]], full: int, scopes: tuple[str, ...]):
    """The first statement of a lookup, as SQL text: built by string joins, because compiling an
    expression of hundreds of VALUES rows took most of a lookup's time. ``q(pos, k)`` holds the
    keys; positions ``0 .. full - 1`` are the full chunks (-1 the root, past them the partial keys).
    Every probe compares scope, kind and node_key for equality: a seek on the primary key."""
    values = ", ".join(f"(:p{i}, :k{i})" for i in range(len(probes)))
    params: dict[str, Any] = {"full": full}
    for i, (pos, key) in enumerate(probes):
        params[f"p{i}"], params[f"k{i}"] = pos, key
    exists, joins = [], []
    for j, scope in enumerate(scopes):
        params[f"s{j}"] = scope
        exists.append(
            f"EXISTS (SELECT 1 FROM prefix_nodes n WHERE n.scope = :s{j} AND n.kind = '{PATH}' AND n.node_key = q.k)"
        )
        for kind, where in ((END, "q.pos < :full"), (PATH, "q.pos >= :full")):
            joins.append(
                f"SELECT q.pos AS pos, n.kind AS kind, n.token_count AS token_count, n.artifact_id AS id FROM q "
                f"JOIN prefix_nodes n ON n.scope = :s{j} AND n.kind = '{kind}' AND n.node_key = q.k WHERE {where}"
            )
    present = (
        "SELECT q.pos AS pos, NULL AS kind, NULL AS token_count, NULL AS id FROM q "
        f"WHERE q.pos >= 0 AND q.pos < :full AND ({' OR '.join(exists)})"
    )
    sql = f"WITH q(pos, k) AS (VALUES {values}) " + " UNION ALL ".join([present, *joins])
    return sa.text(sql), params


def _probes(rows: list[tuple[int, str]]):
    """The keys of one request as a table ``q(pos, k)`` (a VALUES list), joined against the index."""
    return sa.values(sa.column("pos", sa.Integer), sa.column("k", sa.String), name="q").data(rows).cte("q")


def lookup(conn, tenant: str, root: str, keys: list[str], partial: list[str], limit: int) -> dict[str, Any]:
    """The longest match among the artifacts ``tenant`` may see (its own and published ones).

    ``keys`` are the chain keys of the query's full chunks; ``partial[i]`` the key of its first
    ``i + 1`` tokens after the last full chunk. Three statements, whatever the store holds: the first
    seeks each key in the two scopes (does any artifact pass through it; which end in the query's
    last chunk; which whole-prefix artifacts are anchored there), the second the ``limit`` best
    artifacts through the deepest key found, the third reads the rows shown. Nothing depends on how
    many artifacts exist or share a prefix.

    A match through the deepest key counts whole chunks; it carries ``next_tokens``, its token ids in
    the next chunk, with which the client finds the exact length (the caller may read the artifact).
    A whole-prefix artifact that ends inside one of the query's full chunks cannot be checked from
    full-chunk keys: it comes back as a candidate with its ``end_key`` (the key of all its tokens),
    which the client compares with the key of the query's own tokens at that length.
    """
    scopes = (tenant, PUBLIC)
    c = chainkeys.CHUNK_TOKENS
    probes = [(-1, root), *enumerate(keys), *((len(keys) + j, key) for j, key in enumerate(partial))]
    found = conn.execute(*_probe_statement(probes, len(keys), scopes)).all()
    full_path = {r.pos for r in found if r.kind is None}
    depth = 0
    while depth in full_path:  # keys chain: chunk i present means every chunk before it is
        depth += 1
    hits: dict[str, int] = {}  # artifact id -> matched tokens
    exact: set[str] = set()
    anchored: dict[str, int] = {}  # whole-prefix artifact id -> whole chunks before its rest
    for r in found:
        if r.kind == END:
            anchored[r.id] = r.pos + 1
        elif r.kind == PATH and depth == len(keys):
            hits[r.id] = len(keys) * c + (r.pos - len(keys) + 1)
            exact.add(r.id)
    if depth:
        for r in conn.execute(_best(scopes, keys[depth - 1], limit)).all():
            hits.setdefault(r.artifact_id, depth * c)
            if r.token_count == depth * c:
                exact.add(r.artifact_id)
    wanted = sorted({*hits, *anchored})
    rows = conn.execute(sa.select(prefix_artifacts).where(prefix_artifacts.c.artifact_id.in_(wanted))) if wanted else []
    matches, wholes = [], []
    for a in rows:
        if a.root != root or a.scope not in scopes:
            continue
        match = {
            "artifact_id": a.artifact_id,
            "name": a.name,
            "matched_tokens": hits.get(a.artifact_id, 0),
            "exact": a.artifact_id in exact,
            "token_count": a.token_count,
            "reuse": a.reuse,
            "compute_dtype": a.compute_dtype,
            "quantization": a.quantization,
        }
        if a.artifact_id not in anchored:
            if not match["exact"]:  # the client refines it inside the next chunk
                ids = np.frombuffer(a.token_ids, dtype="<u4")[depth * c : (depth + 1) * c]
                match["next_tokens"] = ids.tolist()
            matches.append(match)
            continue
        whole = anchored[a.artifact_id]
        rest = a.token_count - whole * c
        if rest == 0 or (whole == len(keys) and 0 < rest <= len(partial) and partial[rest - 1] == a.end_key):
            wholes.append({**match, "matched_tokens": a.token_count, "exact": True})
        elif whole < len(keys):  # ends inside a full chunk of the query: the client checks its key
            wholes.append({**match, "matched_tokens": whole * c, "exact": False, "end_key": a.end_key})

    def order(m: dict) -> tuple:
        return (-m["matched_tokens"], m["token_count"], m["name"], m["artifact_id"])

    matches.sort(key=order)
    return {
        "root": root,
        "matched_chunks": depth,
        "chunk_tokens": c,
        "matches": sorted(matches[:limit] + wholes, key=order),
    }


def refine(conn, tenant: str, root: str, node: str, chunks: int, blocks: list[str], limit: int) -> dict[str, Any]:
    """A lookup's second step, inside the chunk after ``node`` (the key of the query's first
    ``chunks`` chunks, or the root): ``blocks`` are the keys of that chunk's first 16, 32, ...
    query tokens. The deepest block present narrows the match to 16 tokens; its ``limit`` best
    artifacts come with their token ids to the end of the chunk, from which the client finds the
    exact length. One statement for the blocks, one for the best artifacts, one for their rows."""
    scopes = (tenant, PUBLIC)
    n, c, bt = prefix_nodes.c, chainkeys.CHUNK_TOKENS, chainkeys.BLOCK_TOKENS
    depth = 0
    if blocks:
        q = _probes(list(enumerate(blocks)))
        through = sa.or_(
            *(sa.exists().where(n.scope == scope, n.kind == BLOCK, n.node_key == q.c.k) for scope in scopes)
        )
        present = {r.pos for r in conn.execute(sa.select(q.c.pos).where(through))}
        while depth in present:
            depth += 1
    key, kind = (blocks[depth - 1], BLOCK) if depth else (node, PATH)
    best = {r.artifact_id for r in conn.execute(_best(scopes, key, limit, kind))}
    start = chunks * c + depth * bt
    matches = []
    if best:
        for a in conn.execute(sa.select(prefix_artifacts).where(prefix_artifacts.c.artifact_id.in_(sorted(best)))):
            if a.root != root or a.scope not in scopes or a.token_count < start:
                continue
            matches.append(
                {
                    "artifact_id": a.artifact_id,
                    "name": a.name,
                    "matched_tokens": start,
                    "exact": a.token_count == start,
                    "token_count": a.token_count,
                    "reuse": a.reuse,
                    "compute_dtype": a.compute_dtype,
                    "quantization": a.quantization,
                    "next_tokens": np.frombuffer(a.token_ids, dtype="<u4")[start : (chunks + 1) * c].tolist(),
                }
            )
    matches.sort(key=lambda m: (m["token_count"], m["name"], m["artifact_id"]))
    return {"root": root, "matched_chunks": chunks, "chunk_tokens": c, "matches": matches}
