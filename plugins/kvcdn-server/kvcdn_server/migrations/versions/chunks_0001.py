"""Chunked artifacts: chunk objects stored once, the chunks each artifact and each tenant holds.

Revision ID: chunks_0001
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "chunks_0001"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("record", sa.Text))
        batch.add_column(sa.Column("charge", sa.BigInteger))
    op.create_table(
        "chunks",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("present", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "artifact_chunks",
        sa.Column("artifact_id", sa.String(36), primary_key=True),
        sa.Column("digest", sa.String(64), primary_key=True),
    )
    op.create_index("ix_artifact_chunks_digest", "artifact_chunks", ["digest"])
    op.create_table(
        "tenant_chunks",
        sa.Column("tenant", sa.String(255), primary_key=True),
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    for table in ("tenant_chunks", "artifact_chunks", "chunks"):
        op.drop_table(table)
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("charge")
        batch.drop_column("record")
