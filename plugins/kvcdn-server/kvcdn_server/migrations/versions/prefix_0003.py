"""Head rows of wide nodes (prefix_heads): the keys of the first 1 to 15 tokens of each child of a
node with at least 17 children in a scope, so a query sharing fewer than 16 tokens with all of them
still finds those sharing the most (kvcdn_server.prefix). Filled from prefix_artifacts' token ids.

Revision ID: prefix_0003
Revises: prefix_0002
"""

import blake3
import numpy as np
import sqlalchemy as sa
from alembic import op

from kvcdn_core.store import keys as chainkeys

revision = "prefix_0003"
down_revision = "prefix_0002"
branch_labels = None
depends_on = None

#: as kvcdn_server.prefix.HEADS_FROM when this was written
HEADS_FROM = 17
BATCH = 500


def _heads(parent: bytes, ids: np.ndarray) -> list[bytes]:
    ids = np.ascontiguousarray(ids[:15].astype("<i8"))
    hasher, out = blake3.blake3(parent), []
    for i in range(ids.size):
        hasher.update(ids[i : i + 1].tobytes())
        out.append(hasher.copy().digest())
    return out


def upgrade() -> None:
    conn = op.get_bind()
    heads = op.create_table(
        "prefix_heads",
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("head_key", sa.LargeBinary(32), nullable=False),
        sa.Column("child_key", sa.LargeBinary(32), nullable=False),
        sa.PrimaryKeyConstraint("scope", "head_key", "child_key"),
    )
    e = sa.table("prefix_children", sa.column("scope"), sa.column("parent_key"))
    wide = {
        (r[0], bytes(r[1]))
        for r in conn.execute(
            sa.select(e.c.scope, e.c.parent_key)
            .group_by(e.c.scope, e.c.parent_key)
            .having(sa.func.count() >= HEADS_FROM)
        )
    }
    if not wide:
        return
    a = sa.table("prefix_artifacts", *(sa.column(n) for n in ("artifact_id", "scope", "root", "reuse", "token_ids")))
    c = chainkeys.CHUNK_TOKENS
    rows: set[tuple[str, bytes, bytes]] = set()
    after = ""
    while True:
        batch = conn.execute(sa.select(a).where(a.c.artifact_id > after).order_by(a.c.artifact_id).limit(BATCH)).all()
        if not batch:
            break
        for r in batch:
            if r.reuse != "any_prefix":
                continue
            ids = np.frombuffer(r.token_ids, dtype="<u4").astype(np.int64)
            path = [bytes.fromhex(k) for k in [r.root, *chainkeys.chain(r.root, ids)]]
            for i, (parent, child) in enumerate(zip(path[:-1], path[1:])):
                if (r.scope, parent) in wide:
                    rows.update((r.scope, h, child) for h in _heads(parent, ids[i * c : (i + 1) * c]))
        after = batch[-1].artifact_id
    listed = [{"scope": s, "head_key": h, "child_key": k} for s, h, k in sorted(rows)]
    for start in range(0, len(listed), BATCH * 20):
        conn.execute(heads.insert(), listed[start : start + BATCH * 20])


def downgrade() -> None:
    op.drop_table("prefix_heads")
