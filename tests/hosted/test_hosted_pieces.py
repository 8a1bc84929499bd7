"""Chunk pieces through the hosted service: a chunked upload finds the caller's best matching artifact
with one prefix lookup and builds the chunk that starts inside that artifact's partial last chunk on
its stored pieces, as core's chunk store does. Against a real ``kvcdn serve`` (SQLite; the quota rule
also on PostgreSQL): a 20-turn conversation saved at every turn keeps its history once, every turn
downloads byte-identical, a collection between turns deletes nothing a ready artifact references,
and a piece is reused only from artifacts the caller may read. In-process (SQLite and PostgreSQL):
the quota rule charges a piece once, the collector keeps a piece a ready artifact references, and a
confirm reads every piece back and refuses a damaged one or pieces that do not tile their chunk."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvcdn_core import open_storage
from kvcdn_core.store.chunkstore import open_chunk_store
from tests.hosted.test_store import FAST_GC, db, objects, serve
from tests.support.budget import budget
from tests.support.hosted import mint_key
from tests.support.storefiles import conversation, write_kinds

#: 8 full-attention layers: 1 KiB of cache per token, so the cache, not the token ids, dominates
KINDS = ["full_attention"] * 8


@pytest.fixture(scope="module")
def turns(tmp_path_factory) -> list[Path]:
    return conversation(tmp_path_factory.mktemp("conversation"), 20)


def stored_bytes(home: Path, database_url: str) -> int:
    """What the service keeps for the artifacts: every chunk object once, and every ready record."""
    root = home / "kvcdn" / "server" / "objects" / "chunks"
    with db(database_url).connect() as c:
        records = c.execute(sa.text("SELECT record FROM artifacts WHERE status = 'ready'")).scalars().all()
    return sum(p.stat().st_size for p in root.iterdir()) + sum(len(r.encode()) for r in records)


def referenced(database_url: str) -> set[str]:
    """The objects the ready artifacts reference (the server's own rows)."""
    with db(database_url).connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT r.digest FROM artifact_chunks r JOIN artifacts a ON a.id = r.artifact_id "
                "WHERE a.status = 'ready'"
            )
        )
        return set(rows.scalars())


def collected(store, home: Path, scratch: Path) -> None:
    """Wait for one collection to run from now: an artifact of its own objects is put and deleted,
    then its objects must go (the server's collector runs every 0.2 s here)."""
    store.put(scratch, "scratch")
    gone = {d for d in store.record("scratch").digests}
    store.delete("scratch")
    deadline = time.monotonic() + budget(120)
    while gone & objects(home, "chunks"):
        assert time.monotonic() < deadline, "the collector never ran"
        time.sleep(0.05)


def rule_bytes(database_url: str) -> int:
    """The documented quota rule from the records of the ready artifacts: each distinct object once."""
    from kvcdn_core.store.record import ArtifactRecord
    from kvcdn_server.chunks import objects_of

    found: dict[str, int] = {}
    with db(database_url).connect() as c:
        for text in c.execute(sa.text("SELECT record FROM artifacts WHERE status = 'ready'")).scalars():
            found.update(objects_of(ArtifactRecord.from_json(text.encode())))
    return sum(found.values())


@pytest.fixture
def client_env(monkeypatch):
    for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL", "KVCDN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    return monkeypatch


def test_a_conversation_saved_every_turn_keeps_its_history_once_on_the_service(turns, tmp_path, client_env):
    database_url = f"sqlite:///{tmp_path / 'state.db'}"
    home = tmp_path / "home"
    scratch = tmp_path / "scratch.kv"
    write_kinds(scratch, KINDS[:1], 40, seed=7)
    with serve(home, database_url, FAST_GC) as server:
        client_env.setenv("KVCDN_API_KEY", mint_key(server.url, server.admin_secret(), "chat"))
        backend = open_storage("kvcdn+" + server.url)
        store = open_chunk_store(backend)
        reports = []
        for path in turns:
            reports.append(store.put(path, path.stem))
            collected(store, home, scratch)  # a collection between turns deletes nothing referenced
            assert referenced(database_url) <= objects(home, "chunks")
        final = turns[-1].stat().st_size
        total = stored_bytes(home, database_url)
        assert total <= 1.3 * final, total / final
        # every turn after the first built its first new chunk on the previous turns' stored pieces
        assert all(r.chunks_pieced >= 1 for r in reports[1:]), [r.chunks_pieced for r in reports]
        # and sent only its own rows: the history it shares moved once, by the turn that added it
        moved = sum(r.bytes_moved for r in reports)
        tails = sum(store.record(p.stem).tail.bytes for p in turns)
        assert moved == sum(c.bytes for c in store.record(turns[-1].stem).chunks) + tails
        for path in turns:
            store.get(path.stem, tmp_path / "got.kv")
            assert (tmp_path / "got.kv").read_bytes() == path.read_bytes(), path.stem
        usage = store.storage.client.request("GET", "/api/v1/quota", what="quota").json()["usage"]
        assert usage["storage_bytes"] == rule_bytes(database_url)
        # inspect shows a chunk as its pieces, each one's first piece stored by an earlier turn
        record, rows = store.chunk_table(turns[-1].stem)
        pieced = [i for i, c in enumerate(record.chunks) if c.pieces]
        assert pieced and all(len([r for r in rows if r["chunk"] == i]) == len(record.chunks[i].pieces) for i in pieced)
        assert all(next(r for r in rows if r["chunk"] == i)["shared_with"] > 0 for i in pieced)
        # the early turns deleted: the pieces the kept turns reference outlive them, nothing else does
        kept = turns[-3:]
        for path in turns[:-3]:
            store.delete(path.stem)
        collected(store, home, scratch)
        left = objects(home, "chunks")
        assert left == {d for p in kept for d in store.record(p.stem).digests}
        for path in kept:
            store.get(path.stem, tmp_path / "got.kv")
            assert (tmp_path / "got.kv").read_bytes() == path.read_bytes(), path.stem
        assert any(len(c.pieces) > 2 for c in store.record(kept[0].stem).chunks)
        backend.close()


def test_a_piece_is_reused_only_from_an_artifact_the_caller_may_read(tmp_path, client_env):
    first = write_kinds(tmp_path / "t0.kv", KINDS, 300, seed=1)
    write_kinds(tmp_path / "t1.kv", KINDS, 450, seed=2, prefix_of=first)
    database_url = f"sqlite:///{tmp_path / 'state.db'}"
    with serve(tmp_path / "home", database_url) as server:
        keys = {org: mint_key(server.url, server.admin_secret(), org) for org in ("acme", "beta")}

        def store_of(org):
            client_env.setenv("KVCDN_API_KEY", keys[org])
            return open_chunk_store(open_storage("kvcdn+" + server.url))

        beta, acme = store_of("beta"), store_of("acme")
        beta.put(tmp_path / "t0.kv", "t0")
        # beta's artifact is private: acme's lookup does not see it, so its chunk 1 is stored whole
        alone = acme.put(tmp_path / "t1.kv", "t1")
        assert alone.chunks_pieced == 0 and alone.bytes_saved == 0
        assert all(not c.pieces for c in acme.record("t1").chunks)
        # a record that names beta's private piece anyway: the server answers it missing, as unknown
        from kvcdn_core import artifact
        from kvcdn_core.store import pack
        from kvcdn_hosted import chunked

        piece = beta.record("t0").chunks[1]
        header = artifact.read_header(tmp_path / "t1.kv")
        cutter = pack.Cutter(header, artifact.read_token_ids(tmp_path / "t1.kv", header))
        plan = cutter.plan({1: piece.parts}, lambda _d: False)
        assert plan.chunks[1].pieces[0].digest == piece.digest
        record = pack.record_for("t1", tmp_path / "t1.kv", header, cutter, plan)
        body = {"name": "probe", "sha256": chunked._sha256(tmp_path / "t1.kv"), "record": record.to_dict()}
        grant = acme.storage.client.request("POST", "/api/v1/artifacts/chunked-upload", what="probe", json=body).json()
        assert piece.digest in {m["digest"] for m in grant["missing"]}
        # published, its pieces are anyone's to build on
        beta.storage.upload_chunked(tmp_path / "t0.kv", "t0-public", visibility="public")
        acme.delete("t1")
        shared = acme.put(tmp_path / "t1.kv", "t1")
        assert shared.chunks_pieced == 1 and acme.record("t1").chunks[1].pieces[0].digest == piece.digest
        acme.get("t1", tmp_path / "got.kv")
        assert (tmp_path / "got.kv").read_bytes() == (tmp_path / "t1.kv").read_bytes()
        beta.storage.close()
        acme.storage.close()


# -- the server's side, in-process (16-token chunks, the reuse given directly) -----------------------


@pytest.fixture
def app_on(monkeypatch, tmp_path):
    """The app on local storage and the given database, an API key for each of two orgs."""
    from fastapi.testclient import TestClient

    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config
    from tests.support.clock import ManualClock

    monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme,beta")
    monkeypatch.setenv("KVCDN_INFER_DEVICE", "cpu")
    made = []

    def make(database_url: str):
        config = load_config(storage=str(tmp_path / "objects"), database_url=database_url)
        app = create_app(config, clock=ManualClock())
        client = TestClient(app)
        made.append(client)
        return app, client, {org: derive_key(config.api_key_seed, org) for org in ("acme", "beta")}

    yield make
    for client in made:
        client.close()


def pieced_upload(client, key, path, name, on, prefix):
    """A chunked upload of ``path`` whose plan may build on ``on``'s pieces (its first ``prefix`` tokens)."""
    from kvcdn_core.store.chunkstore import prefix_parts
    from kvcdn_hosted import chunked
    from tests.hosted.test_chunked import CHUNK
    from tests.support.hosted import bearer

    reuse = lambda cutter, _ids: prefix_parts(cutter, on, prefix)  # noqa: E731
    return chunked.upload(client, "", bearer(key), path, name, chunk_tokens=CHUNK, reuse=reuse)


PER_TOKEN = 2 * 2 * 2 * 8 * 4  # write_kv: layers x (key, value) x heads x width x float32 bytes


def test_pieces_are_charged_once_and_outlive_the_artifact_that_stored_them(app_on, tmp_path, database_url):
    """The quota rule counts a piece once per tenant, however many artifacts reference it; the
    collector keeps a piece while any ready artifact references it (SQLite and PostgreSQL)."""
    from tests.hosted.test_chunked import chunk_files, down, rule_bytes, store_of, tenant_of, up, write_kv
    from tests.support.hosted import API, bearer

    app, client, keys = app_on(database_url)
    store, key = store_of(app), keys["acme"]
    t0 = write_kv(tmp_path / "t0.kv", 40)  # 16-token chunks: 16 + 16 + 8
    t1 = write_kv(tmp_path / "t1.kv", 56)  # the same rows, then 16 more: 16 + 16 + (8 + 8) + 8
    first = up(client, key, t0, "t0")
    second = pieced_upload(client, key, t1, "t1", first.record, 40)
    chunk = second.record.chunks[2]
    assert [p.tokens for p in chunk.pieces] == [8, 8] and chunk.pieces[0].digest == first.record.chunks[2].digest
    assert second.bytes_moved == 16 * PER_TOKEN + 56 * 8  # its own rows and its tail, nothing else
    tenant = tenant_of(client, key)
    # each row once, and both tails
    assert (
        store.reserved(tenant) == (2, 56 * PER_TOKEN + (40 + 56) * 8) and rule_bytes(app, tenant) == 56 * 256 + 96 * 8
    )
    assert client.delete(f"{API}/artifacts/{first.artifact_id}", headers=bearer(key)).status_code == 204
    before = chunk_files(tmp_path)
    store.collect()
    assert before - chunk_files(tmp_path) == {first.record.tail.digest}  # its piece is t1's now
    down(client, key, second.artifact_id, tmp_path / "got.kv")
    assert (tmp_path / "got.kv").read_bytes() == t1.read_bytes()
    assert store.reserved(tenant) == (1, rule_bytes(app, tenant)) == (1, 56 * PER_TOKEN + 56 * 8)
    assert client.delete(f"{API}/artifacts/{second.artifact_id}", headers=bearer(key)).status_code == 204
    store.collect()
    assert chunk_files(tmp_path) == set() and store.reserved(tenant) == (0, 0)


def test_a_confirm_reads_every_piece_back_and_refuses_a_damaged_one(app_on, tmp_path):
    from kvcdn_core import artifact
    from kvcdn_core.store import pack
    from kvcdn_core.store.chunkstore import prefix_parts
    from kvcdn_hosted.chunked import _sha256
    from tests.hosted.test_chunked import CHUNK, up, write_kv
    from tests.support.hosted import API, bearer

    app, client, keys = app_on(f"sqlite:///{tmp_path / 'state.db'}")
    auth = bearer(keys["acme"])
    first = up(client, keys["acme"], write_kv(tmp_path / "t0.kv", 40), "t0")
    t1 = write_kv(tmp_path / "t1.kv", 56)
    header = artifact.read_header(t1)
    cutter = pack.Cutter(header, artifact.read_token_ids(t1, header), CHUNK)
    plan = cutter.plan(prefix_parts(cutter, first.record, 40), lambda _d: False)
    record = pack.record_for("t1", t1, header, cutter, plan).to_dict()

    def begin(record):
        body = {"name": "t1", "sha256": _sha256(t1), "record": record}
        return client.post(f"{API}/artifacts/chunked-upload", json=body, headers=auth)

    # pieces that do not tile their chunk: one line, 422
    bad = {**record, "chunks": [dict(c) for c in record["chunks"]]}
    bad["chunks"][2]["pieces"] = [dict(p) for p in bad["chunks"][2]["pieces"]]
    bad["chunks"][2]["pieces"][1]["tokens"] = 7
    r = begin(bad)
    assert r.status_code == 422 and r.json()["error"] == "invalid_record" and "\n" not in r.json()["message"]
    # the piece t0 stored is damaged at rest before t1's confirm: the confirm reads it back, refuses
    grant = begin(record).json()
    piece = plan.chunks[2].pieces[0].digest
    assert piece not in {m["digest"] for m in grant["missing"]}  # the tenant holds it: not sent
    blobs = {b.digest: b for b in plan.blobs}
    for item in grant["missing"]:
        assert client.put(item["url"], content=blobs[item["digest"]].gather()).status_code == 200
    stored = tmp_path / "objects" / "chunks" / piece
    stored.write_bytes(b"\0" * stored.stat().st_size)
    r = client.post(f"{API}/artifacts/{grant['artifact_id']}/confirm-upload", headers=auth)
    assert r.status_code == 422 and r.json()["error"] == "digest_mismatch", r.text
    assert piece in r.json()["message"] and "\n" not in r.json()["message"]
