"""The prefix index's upgrades (prefix_0002: raw-byte keys, no block rows, the chunk tree's edges;
prefix_0003: head rows of wide nodes): an artifact indexed at prefix_0001 (hex keys, a row per
16-token block) is found after the server upgrades, on SQLite and PostgreSQL; the downgrade
rebuilds the old rows; a wide node indexed before prefix_0003 gets its head rows."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import sqlalchemy as sa

from kvcdn_core.store import keys as chainkeys
from tests.hosted.test_prefix_lookup import client_of, hosted, ids_of  # noqa: F401 (a fixture)

C = chainkeys.CHUNK_TOKENS
FP = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}


def alembic(engine: sa.Engine, direction: str, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    from kvcdn_server import db

    config = Config()
    config.set_main_option("script_location", os.path.join(os.path.dirname(db.__file__), "migrations"))
    with engine.connect() as connection:
        config.attributes["connection"] = connection
        getattr(command, direction)(config, revision)
        connection.commit()


def index_at_prefix_0001(conn, scope: str, name: str, root: str, ids) -> str:
    """The rows prefix_0001's confirm wrote for an any-prefix artifact: hex keys, a path row per
    chain key, a block row per 16 tokens inside each chunk."""
    artifact_id = str(uuid.uuid4())
    ids = np.asarray(ids, dtype=np.int64)
    chain = chainkeys.chain(root, ids)
    keys = [("path", k) for k in (root, *chain)]
    for i, parent in enumerate([root, *chain[:-1]]):
        piece = ids[i * C : (i + 1) * C]
        keys += [("block", chainkeys.child_key(parent, piece[:n])) for n in range(16, piece.size, 16)]
    row = {"scope": scope, "token_count": int(ids.size), "name": name, "artifact_id": artifact_id}
    conn.execute(
        sa.text(
            "INSERT INTO prefix_nodes (scope, kind, node_key, token_count, name, artifact_id) "
            "VALUES (:scope, :kind, :node_key, :token_count, :name, :artifact_id)"
        ),
        [{**row, "kind": kind, "node_key": key} for kind, key in keys],
    )
    conn.execute(
        sa.text(
            "INSERT INTO prefix_artifacts (artifact_id, scope, root, name, token_count, reuse, compute_dtype, "
            "quantization, end_key, token_ids) VALUES (:artifact_id, :scope, :root, :name, :token_count, "
            "'any_prefix', 'bfloat16', NULL, :end_key, :token_ids)"
        ),
        {**row, "root": root, "end_key": chain[-1], "token_ids": ids.astype("<u4").tobytes()},
    )
    conn.execute(
        sa.text(
            "INSERT INTO prefix_roots (scope, root, artifacts, model, compute_dtype, quantization) "
            "VALUES (:scope, :root, 1, :model, 'bfloat16', NULL)"
        ),
        {"scope": scope, "root": root, "model": json.dumps(dict(FP, id="old"))},
    )
    return artifact_id


def count(engine, sql: str) -> int:
    with engine.connect() as c:
        return c.execute(sa.text(sql)).scalar_one()


def test_an_artifact_indexed_at_prefix_0001_is_found_after_the_upgrade(database_url, request):
    from kvcdn_server import db

    engine = sa.create_engine(db.database_url(database_url))
    alembic(engine, "upgrade", "prefix_0001")
    root = chainkeys.root_key(FP, chainkeys.representation("bfloat16", None))
    doc = ids_of(30, 700)
    with engine.begin() as c:
        old = index_at_prefix_0001(c, "org:acme", "old-doc", root, doc)
    assert count(engine, "SELECT count(*) FROM prefix_nodes") == 4 + 41
    engine.dispose()

    server = request.getfixturevalue("hosted")  # the server starts: it upgrades the database
    assert count(server.db, "SELECT count(*) FROM prefix_nodes") == 4  # the root, 3 chunk keys; no blocks
    assert count(server.db, "SELECT count(*) FROM prefix_children") == 3
    found = client_of(server, "acme").prefix_lookup(root, doc[:600] + [1, 2], 0, 10)
    assert [(h.ref, h.name, h.prefix_tokens) for h in found] == [(old, "old-doc", 600)]
    assert client_of(server, "beta").prefix_lookup(root, doc[:600], 0, 10) == []  # still private

    # the downgrade rebuilds prefix_0001's rows; upgrading again gives the same index
    alembic(server.db, "downgrade", "prefix_0001")
    assert count(server.db, "SELECT count(*) FROM prefix_nodes WHERE kind = 'block'") == 41
    alembic(server.db, "upgrade", "head")
    assert count(server.db, "SELECT count(*) FROM prefix_nodes") == 4
    found = client_of(server, "acme").prefix_lookup(root, doc[:600] + [1, 2], 0, 10)
    assert [(h.ref, h.prefix_tokens) for h in found] == [(old, 600)]


def test_ready_artifacts_the_index_lacks_are_indexed(database_url, request, tmp_path):
    """An artifact confirmed before the server kept a prefix index (its rows absent) is indexed
    from its object, once, and found; a deleted one is not brought back."""
    from kvcdn_server import prefix
    from tests.hosted.test_prefix_lookup import root_of, write_kv
    from tests.support.hosted import bearer

    server = request.getfixturevalue("hosted")

    doc, gone = ids_of(31, 600), ids_of(32, 600)
    path = write_kv(tmp_path / "doc.kv", doc)
    root = root_of(path)
    kept = server.upload("acme", path, "doc")
    deleted = server.upload("acme", write_kv(tmp_path / "gone.kv", gone), "gone")
    with server.db.begin() as c:  # as before prefix_0001: ready, not indexed
        prefix.drop_artifact(c, kept)
        prefix.drop_artifact(c, deleted)
    assert client_of(server, "acme").prefix_lookup(root, doc, 0, 10) == []
    assert server.client.delete(f"/api/v1/artifacts/{deleted}", headers=bearer(server.keys["acme"])).status_code == 204

    server.app.state.services.store.index_unindexed()  # what the collector's first pass does
    assert server.app.state.services.store.index_unindexed() == 0  # nothing left to do
    assert server.rows(kept) == 1 + 4 and server.rows(deleted) == 0
    found = client_of(server, "acme").prefix_lookup(root, doc[:500] + [1], 0, 10)
    assert [(h.ref, h.prefix_tokens) for h in found] == [(kept, 500)]


def test_a_wide_node_indexed_at_prefix_0002_gets_its_head_rows(database_url, request, monkeypatch):
    """prefix_0003 writes the head rows of the children of every node that has 17 or more in a
    scope (here 40 artifacts going each its own way after one chunk, more than an answer lists),
    so a query sharing under 16 tokens with them is answered completely after the upgrade."""
    from kvcdn_server import db, prefix

    engine = sa.create_engine(db.database_url(database_url))
    alembic(engine, "upgrade", "prefix_0002")
    root = chainkeys.root_key(FP, chainkeys.representation("bfloat16", None))
    base = ids_of(80, C)
    arts = {f"w{i:02d}": base + ids_of(500 + i, 40) for i in range(40)}
    made = {}
    with monkeypatch.context() as m, engine.begin() as c:
        m.setattr(prefix, "_add_heads", lambda conn, entries: None)  # as prefix_0002's confirm did
        for name, ids in arts.items():
            made[name] = str(uuid.uuid4())
            entry = prefix.entry_from_ids(root, "any_prefix", ids, dict(FP, id="old"), "bfloat16", None)
            prefix.index_artifact(c, made[name], "org:acme", name, entry)
    engine.dispose()

    server = request.getfixturevalue("hosted")  # the server starts: it upgrades the database
    assert count(server.db, "SELECT count(*) FROM prefix_heads") == 15 * 40
    query = base + arts["w11"][C : C + 6] + [50_001] * 30
    found = client_of(server, "acme").prefix_lookup(root, query, 0, 10)
    assert [(h.ref, h.prefix_tokens, h.complete) for h in found] == [(made["w11"], C + 6, True)]
    alembic(server.db, "downgrade", "prefix_0002")
    assert "prefix_heads" not in sa.inspect(server.db).get_table_names()
    alembic(server.db, "upgrade", "head")
    assert count(server.db, "SELECT count(*) FROM prefix_heads") == 15 * 40
