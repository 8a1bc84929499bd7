"""Chunked artifacts in the hosted service (the app in-process, a real SQLite database, real
files): round trip, dedup within a tenant, existence kept secret across tenants, the quota rule,
garbage collection of objects, and concurrent uploads, deletes and collections that share chunks."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from tests.support.hosted import API, bearer

CHUNK = 16  # tokens per chunk: small artifacts still have several chunks


def write_kv(path: Path, tokens: int, base_tokens: int = 64, width: int = 8, seed: int = 0) -> Path:
    """A `.kv` of ``tokens`` tokens whose caches are the first ``tokens`` rows of one fixed
    ``base_tokens``-row cache: two such files share their common prefix's chunks byte for byte."""
    import torch

    from kvcdn_core import artifact

    g = torch.Generator().manual_seed(seed)
    tensors = {"token_ids": torch.arange(tokens, dtype=torch.int64)}
    layers = []
    for i in range(2):
        k, v = f"layers.{i}.key", f"layers.{i}.value"
        tensors[k] = torch.randn(1, 2, base_tokens, width, generator=g)[:, :, :tokens].contiguous()
        tensors[v] = torch.randn(1, 2, base_tokens, width, generator=g)[:, :, :tokens].contiguous()
        layers.append({"index": i, "kind": "full_attention", "tensors": {"key": k, "value": v}})
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00Z",
        "model": {"id": "example/not-allowed", "architecture": "Qwen3ForCausalLM", "family": "qwen"},
        "compute_dtype": "float32",
        "layers": layers,
        "quantization": None,
    }
    return artifact.write_artifact(path, manifest, tensors)


@pytest.fixture
def clock():
    from tests.support.clock import ManualClock

    return ManualClock()


@pytest.fixture
def server(monkeypatch, tmp_path, clock):
    """The app on local storage and SQLite (its clock the test's), an API key for each of two orgs."""
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme,beta")
    monkeypatch.setenv("KVCDN_INFER_DEVICE", "cpu")
    config = load_config(storage=str(tmp_path / "objects"))
    app = create_app(config, clock=clock)
    client = TestClient(app)
    keys = {org: derive_key(config.api_key_seed, org) for org in ("acme", "beta")}
    yield app, client, keys
    client.close()


def store_of(app):
    return app.state.services.store


def up(client, key, path, name="a", visibility="private"):
    from kvcdn_hosted import chunked

    return chunked.upload(client, "", bearer(key), path, name, visibility, chunk_tokens=CHUNK)


def down(client, key, artifact_id, target):
    from kvcdn_hosted import chunked

    return chunked.download(client, "", bearer(key), artifact_id, target)


def begin(client, key, path, name="probe"):
    """Only the start of a chunked upload: the server's answer (never confirmed)."""
    from kvcdn_core import artifact
    from kvcdn_core.store import pack
    from kvcdn_hosted.chunked import _sha256

    header = artifact.read_header(path)
    cutter = pack.Cutter(header, artifact.read_token_ids(path, header), CHUNK)
    plan = cutter.plan({}, lambda _d: False)
    record = pack.record_for("probe", path, header, cutter, plan)
    body = {"name": name, "sha256": _sha256(path), "record": record.to_dict()}
    r = client.post(f"{API}/artifacts/chunked-upload", json=body, headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _blobs(path: Path) -> dict[str, bytes]:
    """Every object of a file's chunk plan, by digest."""
    from kvcdn_core import artifact
    from kvcdn_core.store import pack

    header = artifact.read_header(path)
    plan = pack.Cutter(header, artifact.read_token_ids(path, header), CHUNK).plan({}, lambda _d: False)
    return {b.digest: b.gather() for b in plan.blobs}


def tenant_of(client, key) -> str:
    return client.get(f"{API}/whoami", headers=bearer(key)).json()["customer_id"]


def rule_bytes(app, tenant: str) -> int:
    """The documented quota rule, computed from the records of the tenant's ready chunked
    artifacts: each distinct object once."""
    from kvcdn_core.store.record import ArtifactRecord
    from kvcdn_server import chunks
    from kvcdn_server.db import artifacts

    with store_of(app).db.connect() as c:
        rows = c.execute(
            sa.select(artifacts.c.record).where(artifacts.c.tenant == tenant, artifacts.c.status == "ready")
        ).scalars()
        objects: dict[str, int] = {}
        for text in rows:
            objects.update(chunks.objects_of(ArtifactRecord.from_json(text.encode())))
    return sum(objects.values())


def chunk_files(tmp_path) -> set[str]:
    root = tmp_path / "objects" / "chunks"
    return {p.name for p in root.iterdir()} if root.exists() else set()


def test_round_trip_is_byte_exact_and_download_url_serves_the_whole_file(server, tmp_path):
    app, client, keys = server
    src = write_kv(tmp_path / "a.kv", 40)
    report = up(client, keys["acme"], src)
    assert report.bytes_saved == 0 and report.bytes_moved > 0
    got = down(client, keys["acme"], report.artifact_id, tmp_path / "got.kv")
    assert (tmp_path / "got.kv").read_bytes() == src.read_bytes()
    assert got.file_bytes == src.stat().st_size
    # the seed wire: one URL whose bytes are the whole `.kv`, its sha256 as the grant says
    r = client.post(f"{API}/artifacts/{report.artifact_id}/download-url", headers=bearer(keys["acme"]))
    assert r.status_code == 200, r.text
    whole = client.get(r.json()["download_url"])
    assert whole.status_code == 200 and whole.content == src.read_bytes()
    listed = client.get(f"{API}/artifacts", headers=bearer(keys["acme"])).json()["artifacts"]
    assert [(a["artifact_id"], a["chunked"], a["size_bytes"]) for a in listed] == [
        (report.artifact_id, True, src.stat().st_size)
    ]


def test_a_chunked_artifact_enters_the_prefix_index_and_leaves_it_when_deleted(server, tmp_path):
    """The chunked confirm indexes its artifact in the same transaction as a whole-file confirm, and
    a delete takes it out: the hosted lookup finds it by its chain keys, then not at all."""
    import numpy as np

    from kvcdn_core import artifact
    from kvcdn_core.artifact.manifest import manifest_of
    from kvcdn_core.store import keys as chainkeys
    from kvcdn_core.store.pack import root_of

    app, client, keys = server
    src = write_kv(tmp_path / "a.kv", 40)
    report = up(client, keys["acme"], src)
    root = root_of(manifest_of(artifact.read_header(src)))
    query = np.arange(45, dtype=np.int64)  # the artifact's 40 tokens, then 5 more: no full 256-token chunk
    body = {"root": root, "keys": [], "blocks": [chainkeys.first_block(root, query)], "limit": 10}

    def found() -> list[tuple[str, int]]:
        """The hosted client's lookup (one request, refined to the token by the answer's token ids)."""
        from kvcdn_hosted.storage import HostedStorage
        from kvcdn_wire.responses import parse

        def ask(model, sent):
            assert sent == body
            r = client.post(f"{API}/prefix/lookup", headers=bearer(keys["acme"]), json=sent)
            assert r.status_code == 200, r.text
            return parse(model, r.json())

        hosted = HostedStorage(settings=None)
        hosted._lookup = ask  # type: ignore[method-assign]
        return [(h.ref, h.prefix_tokens) for h in hosted.prefix_lookup(root, query, 0, 10)]

    assert found() == [(report.artifact_id, 40)]
    assert client.delete(f"{API}/artifacts/{report.artifact_id}", headers=bearer(keys["acme"])).status_code in (
        200,
        204,
    )
    assert found() == []


def test_a_grant_sends_the_stored_record_without_parsing_its_header_again(server, tmp_path, monkeypatch):
    """The chunks route and a lookup's grant send the record the upload stored, read back from the
    artifact's row without parsing and matching its header again (that was checked once, when the
    upload began): that parse was the largest part of a first-sight lookup's time on the server.
    The lookup reads the grant's row on its own connection, not a second one."""
    import json

    from kvcdn_core import artifact
    from kvcdn_core.artifact.manifest import manifest_of
    from kvcdn_core.store.pack import root_of
    from kvcdn_core.store.record import ArtifactRecord
    from kvcdn_server.db import artifacts
    from tests.hosted.test_prefix_lookup import query_body

    app, client, keys = server
    src = write_kv(tmp_path / "a.kv", 272, base_tokens=272)  # one full 256-token chunk: a lookup grants it
    report = up(client, keys["acme"], src)
    root = root_of(manifest_of(artifact.read_header(src)))
    with store_of(app).db.connect() as c:
        stored = c.execute(sa.select(artifacts.c.record).where(artifacts.c.id == report.artifact_id)).scalar_one()
    record = ArtifactRecord.from_json(stored.encode())
    parsed: list[object] = []
    real = artifact.parse_header
    monkeypatch.setattr(artifact, "parse_header", lambda *a: parsed.append(a[0]) or real(*a))
    r = client.post(f"{API}/artifacts/{report.artifact_id}/chunks", headers=bearer(keys["acme"]))
    assert r.status_code == 200, r.text
    assert r.json()["record"] == json.loads(stored)
    assert [o["digest"] for o in r.json()["objects"]] == sorted(set(record.digests))
    ids = list(range(272)) + [9] * 30
    connections: list[object] = []  # the grant's row is read on the lookup's own connection
    count = connections.append
    sa.event.listen(store_of(app).db, "engine_connect", count)
    r = client.post(f"{API}/prefix/lookup", headers=bearer(keys["acme"]), json=query_body(root, ids, grant=True))
    sa.event.remove(store_of(app).db, "engine_connect", count)
    assert r.status_code == 200, r.text
    grant = r.json()["grant"]
    assert grant["artifact_id"] == report.artifact_id and grant["record"] == json.loads(stored)
    assert parsed == [] and len(connections) == 1


def test_a_lookup_hands_off_to_the_thread_pool_only_for_its_credential_and_its_queries(server, monkeypatch):
    """Each hand-off to the thread pool costs a lookup, which the engine's scheduler waits on, two
    thread switches: the app's services are a coroutine dependency (one attribute read) and the
    answer is checked against its model on the event loop, so what runs in the pool is the API-key
    check and the lookup's own work (its database reads and the grant), once each."""
    import anyio.to_thread

    app, client, keys = server
    handed: list[object] = []
    real = anyio.to_thread.run_sync

    async def run_sync(func, *args, **kwargs):
        handed.append(func)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", run_sync)
    body = {"root": "ab" * 32, "keys": [], "blocks": [], "limit": 1, "grant": True, "steps": []}
    r = client.post(f"{API}/prefix/lookup", headers=bearer(keys["acme"]), json=body)
    assert r.status_code == 200 and r.json()["matches"] == [] and r.json()["grant"] is None, r.text
    assert len(handed) == 2, handed


def test_a_second_artifact_uploads_only_its_new_chunks(server, tmp_path):
    app, client, keys = server
    first = write_kv(tmp_path / "first.kv", 40)  # chunks [0,16) [16,32) [32,40)
    second = write_kv(tmp_path / "second.kv", 56)  # shares [0,16) [16,32)
    one = up(client, keys["acme"], first, "first")
    two = up(client, keys["acme"], second, "second")
    per_token = 2 * 2 * 2 * 8 * 4  # layers x (key, value) x heads x width x float32
    assert two.bytes_saved == 32 * per_token  # the two shared chunks were not sent again
    assert two.bytes_moved == 24 * per_token + 56 * 8  # its own chunks and its tail (token ids)
    for report, src in ((one, first), (two, second)):
        down(client, keys["acme"], report.artifact_id, tmp_path / "got.kv")
        assert (tmp_path / "got.kv").read_bytes() == src.read_bytes()
    tenant = tenant_of(client, keys["acme"])
    quota = client.get(f"{API}/quota", headers=bearer(keys["acme"])).json()
    assert (
        quota["usage"]["storage_bytes"]
        == rule_bytes(app, tenant)
        == (
            (32 + 8 + 24) * per_token + 40 * 8 + 56 * 8  # shared chunks once, each one's own, both tails
        )
    )
    assert store_of(app).reserved(tenant) == (2, rule_bytes(app, tenant))


def test_a_foreign_private_chunk_answers_exactly_as_an_unknown_one(server, tmp_path):
    app, client, keys = server
    src = write_kv(tmp_path / "a.kv", 40)
    up(client, keys["acme"], src, "secret")
    unknown_src = write_kv(tmp_path / "u.kv", 40, seed=7)  # same shape, bytes no tenant holds
    foreign = begin(client, keys["beta"], src)
    unknown = begin(client, keys["beta"], unknown_src)

    def shape(grant):
        return sorted(m["size_bytes"] for m in grant["missing"]), grant["objects"], grant["bytes_present"]

    assert shape(foreign) == shape(unknown)
    assert foreign["bytes_present"] == 0 and len(foreign["missing"]) == foreign["objects"]
    # beta uploads the same bytes: taken (stored once), and beta's copy downloads exactly
    report = up(client, keys["beta"], src, "mine")
    down(client, keys["beta"], report.artifact_id, tmp_path / "got.kv")
    assert (tmp_path / "got.kv").read_bytes() == src.read_bytes()
    # within a tenant, what it holds is present
    again = begin(client, keys["acme"], src)
    assert again["missing"] == [] and again["bytes_present"] == src.stat().st_size - _header_bytes(src)


def test_chunks_of_a_public_artifact_count_as_present_for_everyone(server, tmp_path):
    app, client, keys = server
    src = write_kv(tmp_path / "a.kv", 40)
    up(client, keys["acme"], src, "open", visibility="public")
    grant = begin(client, keys["beta"], src)
    assert grant["missing"] == [] and grant["bytes_present"] == src.stat().st_size - _header_bytes(src)


def _header_bytes(path: Path) -> int:
    from kvcdn_core import artifact

    return artifact.read_header(path).data_start


def test_an_object_whose_bytes_do_not_match_its_digest_is_refused(server, tmp_path):
    app, client, keys = server
    src = write_kv(tmp_path / "a.kv", 40)
    grant = begin(client, keys["acme"], src)
    item = grant["missing"][0]
    r = client.put(item["url"], content=b"\0" * item["size_bytes"])
    assert r.status_code == 422 and r.json()["error"] == "digest_mismatch"
    r = client.put(item["url"], content=b"\0" * (item["size_bytes"] - 1))
    assert r.status_code == 422 and r.json()["error"] == "size_mismatch"
    r = client.post(f"{API}/artifacts/{grant['artifact_id']}/confirm-upload", headers=bearer(keys["acme"]))
    assert r.status_code == 409 and r.json()["error"] == "upload_incomplete"


def test_a_malformed_record_is_one_line_422(server, tmp_path):
    app, client, keys = server
    body = {"name": "x", "sha256": "0" * 64, "record": {"format": "kvcdn-chunked", "version": 1}}
    r = client.post(f"{API}/artifacts/chunked-upload", json=body, headers=bearer(keys["acme"]))
    assert r.status_code == 422 and r.json()["error"] == "invalid_record"
    assert "\n" not in r.json()["message"]


def test_gc_deletes_an_object_only_when_no_artifact_references_it(server, tmp_path):
    app, client, keys = server
    store = store_of(app)
    first = up(client, keys["acme"], write_kv(tmp_path / "first.kv", 40), "first")
    second = up(client, keys["acme"], write_kv(tmp_path / "second.kv", 56), "second")
    before = chunk_files(tmp_path)
    assert client.delete(f"{API}/artifacts/{first.artifact_id}", headers=bearer(keys["acme"])).status_code == 204
    store.collect()
    after = chunk_files(tmp_path)
    # the first's own last chunk and tail went; the chunks it shared with the second stayed
    assert len(before - after) == 2 and after < before
    down(client, keys["acme"], second.artifact_id, tmp_path / "got.kv")
    assert (tmp_path / "got.kv").read_bytes() == (tmp_path / "second.kv").read_bytes()
    tenant = tenant_of(client, keys["acme"])
    assert store.reserved(tenant) == (1, rule_bytes(app, tenant))
    # an upload not confirmed yet protects the objects it sent; once it ends, they go too
    third = write_kv(tmp_path / "third.kv", 24, seed=3)
    grant = begin(client, keys["acme"], third)
    blob = _blobs(third)[grant["missing"][0]["digest"]]
    assert client.put(grant["missing"][0]["url"], content=blob).status_code == 200
    store.collect()
    assert grant["missing"][0]["digest"] in chunk_files(tmp_path)
    assert store.reserved(tenant)[1] == rule_bytes(app, tenant) + grant["bytes_missing"]
    assert client.delete(f"{API}/artifacts/{grant['artifact_id']}", headers=bearer(keys["acme"])).status_code == 204
    assert client.delete(f"{API}/artifacts/{second.artifact_id}", headers=bearer(keys["acme"])).status_code == 204
    store.collect()
    assert chunk_files(tmp_path) == set()
    assert store.reserved(tenant) == (0, 0)
    from kvcdn_server.db import chunks

    with store.db.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(chunks)).scalar_one() == 0


def test_concurrent_uploads_deletes_and_gc_sharing_chunks_keep_every_artifact_and_the_rule(server, tmp_path):
    """Four writers upload and delete artifacts that share chunks while a collector runs all the
    time; then every confirmed artifact downloads byte-exact and usage equals the rule."""
    app, client, keys = server
    store = store_of(app)
    sources = [write_kv(tmp_path / f"s{n}.kv", n) for n in (16, 24, 32, 40, 48, 56, 64)]
    stop = threading.Event()

    def collector():
        while not stop.is_set():
            store.collect()

    kept: dict[str, Path] = {}
    lock = threading.Lock()

    def writer(w: int):
        key = keys["acme" if w % 2 == 0 else "beta"]
        mine = []
        for i in range(6):
            src = sources[(w + i) % len(sources)]
            report = up(client, key, src, f"w{w}-{i}")
            mine.append((key, report.artifact_id, src))
            if i % 2 == 1:  # delete every other one: its shared chunks must stay for the rest
                key_, artifact_id, _ = mine.pop(0)
                assert client.delete(f"{API}/artifacts/{artifact_id}", headers=bearer(key_)).status_code == 204
        with lock:
            kept.update({artifact_id: (key, src) for key, artifact_id, src in mine})

    gc = threading.Thread(target=collector)
    gc.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(writer, range(4)))
    finally:
        stop.set()
        gc.join()
    store.collect()
    for artifact_id, (key, src) in kept.items():
        down(client, key, artifact_id, tmp_path / "got.kv")
        assert (tmp_path / "got.kv").read_bytes() == src.read_bytes()
    for key in keys.values():
        tenant = tenant_of(client, key)
        count = sum(1 for k, _ in kept.values() if k == key)
        assert store.reserved(tenant) == (count, rule_bytes(app, tenant))


def test_an_expired_chunked_upload_gives_back_its_reservation_and_its_objects(server, clock, tmp_path):
    app, client, keys = server
    store = store_of(app)
    tenant = tenant_of(client, keys["acme"])
    src = write_kv(tmp_path / "a.kv", 40)
    grant = begin(client, keys["acme"], src)
    blobs = _blobs(src)
    for item in grant["missing"][:2]:
        assert client.put(item["url"], content=blobs[item["digest"]]).status_code == 200
    assert store.reserved(tenant) == (1, grant["bytes_missing"])
    clock.advance(store.config.upload_ttl + store.config.pending_grace + 1)
    counts = store.collect()
    assert counts["expired"] == 1 and counts["chunks"] == len(blobs)
    assert store.reserved(tenant) == (0, 0) and chunk_files(tmp_path) == set()
    r = client.post(f"{API}/artifacts/{grant['artifact_id']}/confirm-upload", headers=bearer(keys["acme"]))
    assert r.status_code == 410 and r.json()["error"] == "upload_expired"


def test_two_replicas_share_chunks_under_concurrent_uploads_deletes_and_gc(monkeypatch, tmp_path, database_url):
    """Two server replicas (two apps, one database, one object store), each with its collector
    running all the time; writers of two tenants upload and delete artifacts sharing chunks through
    either replica. Then every confirmed artifact downloads byte-exact through both, usage equals
    the rule, and once all are deleted and collected no object and no reference is left."""
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config
    from kvcdn_server.db import artifact_chunks, chunks, tenant_chunks

    monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme,beta")
    monkeypatch.setenv("KVCDN_INFER_DEVICE", "cpu")
    config = load_config(storage=str(tmp_path / "objects"), database_url=database_url)
    apps = [create_app(config), create_app(config)]
    clients = [TestClient(app) for app in apps]
    keys = {org: derive_key(config.api_key_seed, org) for org in ("acme", "beta")}
    sources = [write_kv(tmp_path / f"s{n}.kv", n) for n in (16, 24, 40, 56, 64)]
    stop = threading.Event()

    def collector(app):
        while not stop.is_set():
            store_of(app).collect()

    def writer(w: int):
        key = keys["acme" if w % 2 == 0 else "beta"]
        mine = []
        for i in range(5):
            src = sources[(w + i) % len(sources)]
            report = up(clients[i % 2], key, src, f"w{w}-{i}")
            mine.append(report.artifact_id)
            if i % 2 == 1:
                gone = mine.pop(0)
                assert clients[(i + 1) % 2].delete(f"{API}/artifacts/{gone}", headers=bearer(key)).status_code == 204

    gcs = [threading.Thread(target=collector, args=(app,)) for app in apps]
    for t in gcs:
        t.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(writer, range(4)))
    finally:
        stop.set()
        for t in gcs:
            t.join()
    store = store_of(apps[0])
    store.collect()
    for key in keys.values():
        tenant = tenant_of(clients[0], key)
        listed = clients[0].get(f"{API}/artifacts", headers=bearer(key)).json()["artifacts"]
        assert store.reserved(tenant) == (len(listed), rule_bytes(apps[0], tenant))
        for n, entry in enumerate(listed):
            w, i = (int(x) for x in entry["name"][1:].split("-"))
            src = sources[(w + i) % len(sources)]
            down(clients[n % 2], key, entry["artifact_id"], tmp_path / "got.kv")
            assert (tmp_path / "got.kv").read_bytes() == src.read_bytes()
            assert (
                clients[n % 2].delete(f"{API}/artifacts/{entry['artifact_id']}", headers=bearer(key)).status_code == 204
            )
        assert store.reserved(tenant) == (0, 0)
    store.collect()
    assert chunk_files(tmp_path) == set()
    with store.db.connect() as c:
        for table in (chunks, artifact_chunks, tenant_chunks):
            assert c.execute(sa.select(sa.func.count()).select_from(table)).scalar_one() == 0
    for client in clients:
        client.close()


def test_gc_that_listed_an_object_before_a_new_upload_referenced_it_keeps_it(server, tmp_path):
    """The race: the collector lists an object as unreferenced (its artifact was deleted), a new
    upload then references it and sends it, and only then does the collector come to it. It must
    see the new reference and keep the object; the upload confirms and downloads exactly."""
    app, client, keys = server
    store = store_of(app)
    src = write_kv(tmp_path / "a.kv", 40)
    first = up(client, keys["acme"], src, "first")
    assert client.delete(f"{API}/artifacts/{first.artifact_id}", headers=bearer(keys["acme"])).status_code == 204
    listed = store.objects.orphans()
    assert len(listed) == len(_blobs(src))
    grant = begin(client, keys["acme"], src, "second")
    blobs = _blobs(src)
    for item in grant["missing"]:
        assert client.put(item["url"], content=blobs[item["digest"]]).status_code == 200
    assert [store.objects.remove_unreferenced(d) for d in listed] == [False] * len(listed)
    r = client.post(f"{API}/artifacts/{grant['artifact_id']}/confirm-upload", headers=bearer(keys["acme"]))
    assert r.status_code == 200, r.text
    down(client, keys["acme"], grant["artifact_id"], tmp_path / "got.kv")
    assert (tmp_path / "got.kv").read_bytes() == src.read_bytes()


def test_cli_upload_and_download_by_chunks_against_a_real_server(tmp_path, monkeypatch):
    """``kvcdn upload --chunked`` sends only the chunks the server lacks and says so; ``kvcdn
    download --chunked`` rebuilds the file exactly, and so does a plain ``kvcdn download`` (the
    seed wire's single URL); ``kvcdn list`` shows both artifacts."""
    import json

    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli
    from tests.support import services
    from tests.support.hosted import mint_key

    # 256-token chunks (the default): two files sharing a 512-token prefix
    first = write_kv(tmp_path / "first.kv", 600, base_tokens=900, width=4)
    second = write_kv(tmp_path / "second.kv", 900, base_tokens=900, width=4)
    with services.kvcdn_server(tmp_path / "home") as server:
        key = mint_key(server.url, server.admin_secret(), "chunky")
        for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("KVCDN_TELEMETRY", "0")
        monkeypatch.setenv("KVCDN_API_URL", server.url)
        monkeypatch.setenv("KVCDN_API_KEY", key)

        def kv(*args):
            result = CliRunner().invoke(make_cli(), [str(a) for a in args])
            assert result.exit_code == 0, (result.stdout, result.stderr)
            return result.stdout

        one = json.loads(kv("upload", first, "--chunked", "--format", "json", "--quiet"))
        two = json.loads(kv("upload", second, "--chunked", "--format", "json", "--quiet"))
        per_token = 2 * 2 * 2 * 4 * 4
        assert one["bytes_saved"] == 0
        # the two full chunks they share, and first's partial chunk 2 as the first piece of second's
        assert two["bytes_saved"] == 600 * per_token
        assert two["bytes_moved"] == (900 - 600) * per_token + 900 * 8
        got = json.loads(kv("download", two["artifact_id"], "-o", tmp_path / "a.kv", "--chunked", "--format", "json"))
        assert (tmp_path / "a.kv").read_bytes() == second.read_bytes() and got["bytes_moved"] > 0
        kv("download", one["artifact_id"], "-o", tmp_path / "b.kv", "--quiet")
        assert (tmp_path / "b.kv").read_bytes() == first.read_bytes()
        listed = json.loads(kv("list", "--format", "json"))
        assert sorted((a["name"], a["chunked"]) for a in listed) == [("first", True), ("second", True)]


def test_a_chunked_download_reads_objects_through_the_object_reader_and_a_gone_one_leaves_no_file(tmp_path):
    """``download_chunked`` reads each object's signed URL through the client's ``ObjectReader``
    (real HTTP); an object deleted between the grant and its GET is one error line and no file,
    not even a temporary one, is left."""
    import httpx

    from kvcdn_core import KvcdnError
    from kvcdn_hosted import chunked
    from kvcdn_hosted.objects import ObjectReader
    from tests.hosted.test_store import objects
    from tests.support import services
    from tests.support.hosted import mint_key

    src = write_kv(tmp_path / "src.kv", 60)
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    with services.kvcdn_server(home) as server, httpx.Client(timeout=120) as http:
        auth = bearer(mint_key(server.url, server.admin_secret(), "acme"))
        artifact_id = chunked.upload(http, server.url, auth, src, "a", chunk_tokens=CHUNK).artifact_id
        reader, read = ObjectReader(http, "kvcdn-test"), []

        def get(url):
            read.append(url)
            return reader.get(url)

        report = chunked.download(http, server.url, auth, artifact_id, out / "a.kv", get)
        assert (out / "a.kv").read_bytes() == src.read_bytes()
        assert len(read) == report.objects > 1

        def get_after_a_delete(url):
            for name in objects(home, "chunks"):
                (home / "kvcdn" / "server" / "objects" / "chunks" / name).unlink()
            return reader.get(url)

        with pytest.raises(KvcdnError, match="is no longer served"):
            chunked.download(http, server.url, auth, artifact_id, out / "b.kv", get_after_a_delete)
        assert sorted(p.name for p in out.iterdir()) == ["a.kv"]
        reader.close()


def test_killed_during_a_chunked_upload_no_artifact_loses_a_chunk_and_orphans_are_reclaimed(
    database_url, tmp_path, progress
):
    """``kvcdn serve`` killed with SIGKILL while an object of a chunked upload is streaming in.
    After a restart: the confirmed artifact that shares chunks with it downloads byte-exact, every
    object a ready artifact references is stored, the cut upload can still be finished, and once an
    abandoned one is deleted the collector reclaims its objects and the dead PUT's temp file."""
    import signal
    import time

    import httpx

    from kvcdn_hosted import chunked
    from tests.hosted.test_store import _put_quietly, _slow_body, objects, serve
    from tests.support.budget import budget
    from tests.support.hosted import mint_key

    home = tmp_path / "home"
    tmp_dir = home / "kvcdn" / "server" / "tmp"
    kept = write_kv(tmp_path / "kept.kv", 40, base_tokens=96, width=512)
    cut = write_kv(tmp_path / "cut.kv", 96, base_tokens=96, width=512)  # shares kept's first two chunks
    abandoned = write_kv(tmp_path / "abandoned.kv", 24, base_tokens=24, width=512, seed=5)
    progress("server 1 of 2: killed while an object is streaming in")
    with serve(home, database_url) as server, httpx.Client(timeout=120) as http:
        key = mint_key(server.url, server.admin_secret(), "acme")
        auth = bearer(key)
        first = chunked.upload(http, server.url, auth, kept, "kept", chunk_tokens=CHUNK)
        grant = _begin_http(http, server.url, auth, cut, "cut")
        left = _begin_http(http, server.url, auth, abandoned, "abandoned")
        blobs = _blobs(cut)
        done, slow = grant["missing"][:-1], grant["missing"][-1]
        for item in done:
            assert http.put(item["url"], content=blobs[item["digest"]]).status_code == 200
        started = threading.Event()
        size = slow["size_bytes"]
        put = threading.Thread(target=_put_quietly, args=(slow["url"], _slow_body(size, started), size))
        put.start()
        assert started.wait(budget(120))
        deadline = time.monotonic() + budget(120)
        while not list(tmp_dir.glob(".chunk-*")):
            assert time.monotonic() < deadline, "the PUT never reached the disk"
            time.sleep(0.01)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        put.join()
    progress("server 2 of 2: nothing lost, the rest reclaimed")
    with serve(home, database_url) as server, httpx.Client(timeout=120) as http:
        _assert_every_ready_reference_is_stored(database_url, home)
        chunked.download(http, server.url, auth, first.artifact_id, tmp_path / "got.kv")
        assert (tmp_path / "got.kv").read_bytes() == kept.read_bytes()
        # the cut upload: its last object is sent again (the URL holds the digest, not the host)
        url = f"{server.url}/{slow['url'].split('/', 3)[3]}"
        assert http.put(url, content=blobs[slow["digest"]]).status_code == 200
        r = http.post(f"{server.url}{API}/artifacts/{grant['artifact_id']}/confirm-upload", headers=auth)
        assert r.status_code == 200, r.text
        chunked.download(http, server.url, auth, grant["artifact_id"], tmp_path / "got.kv")
        assert (tmp_path / "got.kv").read_bytes() == cut.read_bytes()
        assert http.delete(f"{server.url}{API}/artifacts/{left['artifact_id']}", headers=auth).status_code == 204
        wanted = set(_blobs(kept)) | set(blobs)
        deadline = time.monotonic() + budget(120)
        while objects(home, "chunks") != wanted or list(tmp_dir.glob(".chunk-*")):
            assert time.monotonic() < deadline, (len(objects(home, "chunks")), len(wanted))
            time.sleep(0.1)
        _assert_every_ready_reference_is_stored(database_url, home)
        usage = http.get(f"{server.url}{API}/quota", headers=auth).json()["usage"]
        object_bytes = sum(len(b) for b in {**_blobs(kept), **blobs}.values())
        assert usage == {"artifacts": 2, "storage_bytes": object_bytes, "pending_artifacts": 0, "pending_bytes": 0}


def _begin_http(http, base, auth, path, name):
    from kvcdn_core import artifact
    from kvcdn_core.store import pack
    from kvcdn_hosted.chunked import _sha256

    header = artifact.read_header(path)
    cutter = pack.Cutter(header, artifact.read_token_ids(path, header), CHUNK)
    record = pack.record_for("probe", path, header, cutter, cutter.plan({}, lambda _d: False))
    body = {"name": name, "sha256": _sha256(path), "record": record.to_dict()}
    r = http.post(f"{base}{API}/artifacts/chunked-upload", json=body, headers=auth)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_every_ready_reference_is_stored(database_url, home):
    from tests.hosted.test_store import db, objects

    stored = objects(home, "chunks")
    with db(database_url).connect() as c:
        refs = c.execute(
            sa.text(
                "SELECT r.digest, k.present FROM artifact_chunks r JOIN artifacts a ON a.id = r.artifact_id "
                "LEFT JOIN chunks k ON k.digest = r.digest WHERE a.status = 'ready'"
            )
        ).all()
    assert refs and all(present and digest in stored for digest, present in refs)
