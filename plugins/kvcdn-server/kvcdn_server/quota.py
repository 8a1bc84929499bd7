"""Quota: what a tenant may hold, reserved at upload-url and given back when an upload ends.

A reservation is one atomic conditional UPDATE of the tenant's usage row
(``... WHERE artifacts + 1 <= quota AND bytes + size <= quota``), so replicas on one database
cannot over-grant. Apart from the uploads because it is the one rule that spans all of a tenant's
uploads; the state machine calls it inside its own transactions (the ``c`` arguments).
"""

from __future__ import annotations

import contextlib

import sqlalchemy as sa

from kvcdn_server.db import artifacts, tenant_chunks, usage
from kvcdn_server.errors import ApiError
from kvcdn_server.rows import LIVE
from kvcdn_wire import ErrorCode


class Quota:
    """The tenant's limits, usage and reservations."""

    def __init__(self, db_engine: sa.Engine, reads: sa.Engine, config):
        self.db = db_engine
        self.reads = reads
        self.config = config

    def limits(self) -> dict[str, int]:
        return {
            "artifacts": self.config.quota_artifacts,
            "storage_bytes": self.config.quota_bytes,
            "max_artifact_bytes": self.config.max_artifact_bytes,
        }

    def usage(self, tenant: str) -> dict[str, int]:
        """Ready artifacts and uploads in flight, counted from the artifacts table."""
        # a whole file counts its size; an open chunked upload its reservation; a ready chunked
        # artifact nothing of its own: the tenant's distinct objects count once (tenant_chunks)
        held = sa.func.coalesce(artifacts.c.charge, artifacts.c.size_bytes)
        query = (
            sa.select(artifacts.c.status, sa.func.count(), sa.func.coalesce(sa.func.sum(held), 0))
            .where(artifacts.c.tenant == tenant, artifacts.c.status.in_(LIVE))
            .group_by(artifacts.c.status)
        )
        objects = sa.select(sa.func.coalesce(sa.func.sum(tenant_chunks.c.size_bytes), 0)).where(
            tenant_chunks.c.tenant == tenant
        )
        out = {"artifacts": 0, "storage_bytes": 0, "pending_artifacts": 0, "pending_bytes": 0}
        with self.reads.connect() as c:
            for status, count, size in c.execute(query):
                prefix = "" if status == "ready" else "pending_"
                out[f"{prefix}artifacts"] += int(count)
                out[f"{prefix}{'storage_bytes' if status == 'ready' else 'bytes'}"] += int(size)
            out["storage_bytes"] += int(c.execute(objects).scalar_one())
        return out

    def reserved(self, tenant: str) -> tuple[int, int]:
        """The tenant's reservation counter (artifacts, bytes): what upload-url checks the quota against."""
        with self.reads.connect() as c:
            row = c.execute(sa.select(usage.c.artifacts, usage.c.bytes).where(usage.c.tenant == tenant)).first()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def reserve(self, c, tenant: str, size: int) -> bool:
        grant = (
            usage.update()
            .where(
                usage.c.tenant == tenant,
                usage.c.artifacts + 1 <= self.config.quota_artifacts,
                usage.c.bytes + size <= self.config.quota_bytes,
            )
            .values(artifacts=usage.c.artifacts + 1, bytes=usage.c.bytes + size)
        )
        return c.execute(grant).rowcount == 1

    def refusal(self, c, tenant: str) -> ApiError:
        """Why :meth:`reserve` granted nothing: the artifact count or the bytes (403)."""
        held = c.execute(sa.select(usage.c.artifacts).where(usage.c.tenant == tenant)).scalar_one()
        if held + 1 > self.config.quota_artifacts:
            return ApiError(403, ErrorCode.QUOTA_EXCEEDED, f"artifact quota of {self.config.quota_artifacts} reached")
        return ApiError(
            403, ErrorCode.QUOTA_EXCEEDED, f"storage quota of {self.config.quota_bytes} bytes would be exceeded"
        )

    @staticmethod
    def release(c, tenant: str, size: int) -> None:
        c.execute(
            usage.update()
            .where(usage.c.tenant == tenant)
            .values(artifacts=usage.c.artifacts - 1, bytes=usage.c.bytes - size)
        )

    def ensure_row(self, tenant: str) -> None:
        with contextlib.suppress(sa.exc.IntegrityError), self.db.begin() as c:
            if c.execute(sa.select(usage.c.tenant).where(usage.c.tenant == tenant)).first() is None:
                c.execute(usage.insert().values(tenant=tenant, artifacts=0, bytes=0))

    @staticmethod
    def lock(c, tenant: str) -> None:
        """Hold the tenant's usage row until the transaction ends: confirms that replace and deletes
        of one tenant queue there (a no-op update takes the row lock on every database)."""
        c.execute(usage.update().where(usage.c.tenant == tenant).values(artifacts=usage.c.artifacts))
