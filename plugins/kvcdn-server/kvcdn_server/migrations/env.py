"""Alembic environment: runs on the connection ``kvcdn_server.db.migrate`` hands over."""

from alembic import context
from sqlalchemy import text

#: any constant: replicas migrating at once on PostgreSQL take this lock in turn
MIGRATION_LOCK = 0x6B76636E

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None, transactional_ddl=True)
with context.begin_transaction():
    if connection.dialect.name == "postgresql":
        connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"))
    context.run_migrations()
