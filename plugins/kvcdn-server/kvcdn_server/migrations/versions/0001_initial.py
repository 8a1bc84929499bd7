"""The first schema: artifacts, usage, orgs, telemetry_limits.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("visibility", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("declared", sa.Text, nullable=False),
        sa.Column("manifest", sa.Text),
        sa.Column("multipart_id", sa.Text),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("confirmed_at", sa.Float),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("lease_until", sa.Float),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("error", sa.Text),
    )
    op.create_index("ix_artifacts_tenant_status_id", "artifacts", ["tenant", "status", "id"])
    op.create_index("ix_artifacts_status", "artifacts", ["status"])
    op.create_table(
        "usage",
        sa.Column("tenant", sa.String(255), primary_key=True),
        sa.Column("artifacts", sa.BigInteger, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "orgs",
        sa.Column("slug", sa.String(64), primary_key=True),
        sa.Column("generation", sa.Integer, nullable=False),
    )
    op.create_table(
        "telemetry_limits",
        sa.Column("client", sa.String(64), primary_key=True),
        sa.Column("tokens", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for table in ("telemetry_limits", "orgs", "usage", "artifacts"):
        op.drop_table(table)
