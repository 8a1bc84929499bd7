"""The prefix index in one request: keys as 32 raw bytes, no block rows, the chunk tree's edges
(prefix_children, with the key of each child's first 16 tokens). The node rows are rebuilt from prefix_artifacts, which holds every indexed
artifact's root, reuse rule and token ids (kvcdn_server.prefix).

Revision ID: prefix_0002
Revises: prefix_0001
"""

from collections import Counter

import numpy as np
import sqlalchemy as sa
from alembic import op

from kvcdn_core.store import keys as chainkeys

revision = "prefix_0002"
down_revision = "prefix_0001"
branch_labels = None
depends_on = None

#: artifacts read per batch while rebuilding (each holds its token ids: 16 kB at 4k tokens)
BATCH = 500


def _nodes(key_type) -> sa.Table:
    return sa.Table(
        "prefix_nodes",
        sa.MetaData(),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("node_key", key_type, nullable=False),
        sa.Column("token_count", sa.BigInteger, nullable=False),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("artifact_id", sa.String(36), nullable=False),
        sa.PrimaryKeyConstraint("scope", "kind", "node_key", "token_count", "name", "artifact_id"),
    )


def _artifacts(conn):
    """Every indexed artifact with the keys of its path (the root, then each chunk), in batches."""
    a = sa.table(
        "prefix_artifacts",
        *(sa.column(n) for n in ("artifact_id", "scope", "root", "name", "token_count", "reuse", "token_ids")),
    )
    after = ""
    while True:
        rows = conn.execute(sa.select(a).where(a.c.artifact_id > after).order_by(a.c.artifact_id).limit(BATCH)).all()
        if not rows:
            return
        for r in rows:
            ids = np.frombuffer(r.token_ids, dtype="<u4").astype(np.int64)
            yield r, ids, chainkeys.chain(r.root, ids)
        after = rows[-1].artifact_id


def _row(r, kind: str, key) -> dict:
    return {
        "scope": r.scope,
        "kind": kind,
        "node_key": key,
        "token_count": r.token_count,
        "name": r.name,
        "artifact_id": r.artifact_id,
    }


def _insert(conn, table: sa.Table, rows: list[dict]) -> None:
    if rows:
        conn.execute(table.insert(), rows)
        rows.clear()


def upgrade() -> None:
    conn = op.get_bind()
    op.drop_index("ix_prefix_nodes_artifact", table_name="prefix_nodes")
    op.drop_table("prefix_nodes")
    nodes = _nodes(sa.LargeBinary(32))
    nodes.create(conn)
    op.create_index("ix_prefix_nodes_artifact", "prefix_nodes", ["artifact_id"])
    children = op.create_table(
        "prefix_children",
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("parent_key", sa.LargeBinary(32), nullable=False),
        sa.Column("block_key", sa.LargeBinary(32), nullable=False),
        sa.Column("child_key", sa.LargeBinary(32), nullable=False),
        sa.Column("artifacts", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("scope", "parent_key", "block_key", "child_key"),
    )
    c = chainkeys.CHUNK_TOKENS
    rows: list[dict] = []
    edges: Counter = Counter()
    for r, ids, chain in _artifacts(conn):
        if r.reuse == "any_prefix":
            path = [r.root, *chain]
            rows += [_row(r, "path", bytes.fromhex(k)) for k in path]
            for i, (parent, child) in enumerate(zip(path[:-1], path[1:])):
                piece = ids[i * c : (i + 1) * c]
                block = bytes.fromhex(chainkeys.child_key(parent, piece[:16])) if piece.size >= 16 else b""
                edges[(r.scope, bytes.fromhex(parent), block, bytes.fromhex(child))] += 1
        else:
            whole = ids.size // c
            rows.append(_row(r, "end", bytes.fromhex(chain[whole - 1] if whole else r.root)))
        if len(rows) >= BATCH * 20:
            _insert(conn, nodes, rows)
    _insert(conn, nodes, rows)
    counted = [
        {"scope": s, "parent_key": p, "block_key": b, "child_key": k, "artifacts": n}
        for (s, p, b, k), n in edges.items()
    ]
    for start in range(0, len(counted), BATCH * 20):
        _insert(conn, children, counted[start : start + BATCH * 20])


def downgrade() -> None:
    """Back to hex keys with block rows (every chunk's first 16, 32, ... tokens), rebuilt the same way."""
    conn = op.get_bind()
    op.drop_table("prefix_children")
    op.drop_index("ix_prefix_nodes_artifact", table_name="prefix_nodes")
    op.drop_table("prefix_nodes")
    nodes = _nodes(sa.String(64))
    nodes.create(conn)
    op.create_index("ix_prefix_nodes_artifact", "prefix_nodes", ["artifact_id"])
    c = chainkeys.CHUNK_TOKENS
    rows: list[dict] = []
    for r, ids, chain in _artifacts(conn):
        if r.reuse == "any_prefix":
            rows += [_row(r, "path", k) for k in (r.root, *chain)]
            for i, parent in enumerate([r.root, *chain[:-1]]):
                piece = ids[i * c : (i + 1) * c]
                rows += [_row(r, "block", chainkeys.child_key(parent, piece[:n])) for n in range(16, piece.size, 16)]
        else:
            whole = ids.size // c
            rows.append(_row(r, "end", chain[whole - 1] if whole else r.root))
        if len(rows) >= BATCH * 20:
            _insert(conn, nodes, rows)
    _insert(conn, nodes, rows)
