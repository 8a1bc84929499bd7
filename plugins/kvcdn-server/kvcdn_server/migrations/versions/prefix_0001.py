"""The hosted prefix index: prefix_nodes, prefix_artifacts, prefix_roots (kvcdn_server.prefix).

Revision ID: prefix_0001
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "prefix_0001"
down_revision = "chunks_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "prefix_nodes",
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("node_key", sa.String(64), nullable=False),
        sa.Column("token_count", sa.BigInteger, nullable=False),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("artifact_id", sa.String(36), nullable=False),
        sa.PrimaryKeyConstraint("scope", "kind", "node_key", "token_count", "name", "artifact_id"),
    )
    op.create_index("ix_prefix_nodes_artifact", "prefix_nodes", ["artifact_id"])
    op.create_table(
        "prefix_artifacts",
        sa.Column("artifact_id", sa.String(36), primary_key=True),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("root", sa.String(64), nullable=False),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("token_count", sa.BigInteger, nullable=False),
        sa.Column("reuse", sa.String(16), nullable=False),
        sa.Column("compute_dtype", sa.String(32)),
        sa.Column("quantization", sa.String(64)),
        sa.Column("end_key", sa.String(64), nullable=False),
        sa.Column("token_ids", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "prefix_roots",
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("root", sa.String(64), nullable=False),
        sa.Column("artifacts", sa.BigInteger, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("compute_dtype", sa.String(32)),
        sa.Column("quantization", sa.String(64)),
        sa.PrimaryKeyConstraint("scope", "root"),
    )


def downgrade() -> None:
    for table in ("prefix_roots", "prefix_artifacts", "prefix_nodes"):
        op.drop_table(table)
