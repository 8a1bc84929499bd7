"""The server's metadata store: one transactional database through SQLAlchemy (SQLite or PostgreSQL).

Every piece of state lives here (artifacts and their upload sessions, per-tenant quota
reservations, org API-key generations, telemetry rate limits); object storage holds only bytes
under keys the server chose. The schema is created and upgraded by the Alembic migrations shipped
in ``kvcdn_server/migrations``, applied on start (replicas starting together take turns).
"""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event

from kvcdn_core import KvcdnError

metadata = sa.MetaData()

#: one row per artifact, from its upload-url to its deletion (see the state machine in docs/hosted-api.md)
artifacts = sa.Table(
    "artifacts",
    metadata,
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
    #: a chunked artifact's record (JSON, kvcdn_core.store.record); NULL for a whole-file artifact
    sa.Column("record", sa.Text),
    #: a chunked upload's quota reservation while it is open (0 once ready: its chunks are charged
    #: through ``tenant_chunks``); NULL for a whole-file artifact, whose ``size_bytes`` is charged
    sa.Column("charge", sa.BigInteger),
    sa.Index("ix_artifacts_tenant_status_id", "tenant", "status", "id"),
    sa.Index("ix_artifacts_status", "status"),
)

#: what each tenant holds or has reserved: ready artifacts plus uploads in flight
usage = sa.Table(
    "usage",
    metadata,
    sa.Column("tenant", sa.String(255), primary_key=True),
    sa.Column("artifacts", sa.BigInteger, nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
)

#: every chunk object, stored once for all tenants under ``chunks/<digest>`` (BLAKE3 of its bytes);
#: ``present`` once a PUT's bytes hashed to the digest and were stored (see kvcdn_server.chunks)
chunks = sa.Table(
    "chunks",
    metadata,
    sa.Column("digest", sa.String(64), primary_key=True),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("present", sa.Boolean, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

#: which chunks an artifact (a live upload or a ready artifact) references: written when the
#: chunked upload starts, removed with the artifact; the collector keeps every chunk named here
artifact_chunks = sa.Table(
    "artifact_chunks",
    metadata,
    sa.Column("artifact_id", sa.String(36), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True),
    sa.Index("ix_artifact_chunks_digest", "digest"),
)

#: the distinct chunks a tenant's ready artifacts reference: each is charged to its quota once
tenant_chunks = sa.Table(
    "tenant_chunks",
    metadata,
    sa.Column("tenant", sa.String(255), primary_key=True),
    sa.Column("digest", sa.String(64), primary_key=True),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
)

orgs = sa.Table(
    "orgs",
    metadata,
    sa.Column("slug", sa.String(64), primary_key=True),
    sa.Column("generation", sa.Integer, nullable=False),
)

telemetry_limits = sa.Table(
    "telemetry_limits",
    metadata,
    sa.Column("client", sa.String(64), primary_key=True),
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)


def database_url(value: str) -> str:
    """A SQLAlchemy URL from what users write: ``postgresql://`` uses psycopg 3, a bare path is SQLite."""
    if "://" not in value:
        return f"sqlite:///{Path(value).expanduser().resolve()}"
    scheme, rest = value.split("://", 1)
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    if scheme in ("postgresql+psycopg", "sqlite"):
        return value
    raise KvcdnError(f"database URL must be postgresql://... or sqlite:///PATH, not '{scheme}://...'")


def open_database(url: str) -> sa.Engine:
    """An engine on ``url`` with the schema migrated to the newest version."""
    url = database_url(url)
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            url, connect_args={"timeout": 60, "check_same_thread": False}, pool_size=20, max_overflow=20
        )
        _serialise_sqlite_writers(engine)
    else:
        engine = sa.create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)
    try:
        migrate(engine)
    except sa.exc.OperationalError as exc:
        raise KvcdnError(f"cannot open the database: {str(exc.orig).strip().splitlines()[0]}") from None
    return engine


def _serialise_sqlite_writers(engine: sa.Engine) -> None:
    """SQLite: WAL, and every transaction that may write begins IMMEDIATE (writers queue instead of
    failing with BUSY)."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection):
        # A transaction that may write takes the write lock up front: a deferred one that reads and
        # then writes could not upgrade its lock under contention. Reads (see readers()) do not wait.
        reads = connection.get_execution_options().get("kvcdn_read_only")
        connection.exec_driver_sql("BEGIN" if reads else "BEGIN IMMEDIATE")


def readers(engine: sa.Engine) -> sa.Engine:
    """The same engine for read-only transactions (on SQLite they do not queue behind writers)."""
    return engine.execution_options(kvcdn_read_only=True)


def migrate(engine: sa.Engine) -> None:
    """Apply the shipped Alembic migrations (idempotent; concurrent starts serialise on a lock)."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", os.path.join(os.path.dirname(__file__), "migrations"))
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
        connection.commit()
