"""The chunk store on the S3 backend, against moto's S3 server (real HTTP, real boto3), and the
``kvcdn store`` commands on a directory and on S3."""

from __future__ import annotations

import json

import pytest

from kvcdn_core.plugin_host.registry import open_storage
from kvcdn_core.store.chunkstore import ChunkStore, chunk_key
from tests.support import services
from tests.support.storefiles import churn, write_kinds

BUCKET = "kvcdn-store-test"


@pytest.fixture(scope="module")
def moto():
    with services.moto_s3(BUCKET) as s3:
        yield s3


@pytest.fixture
def s3_uri(moto, monkeypatch, request):
    for name, value in moto.env.items():
        monkeypatch.setenv(name, value)
    return f"s3://{BUCKET}/{request.node.name[:40]}"


@pytest.fixture
def pair(tmp_path):
    first = tmp_path / "first.kv"
    tensors = write_kinds(first, ["full_attention", "sliding_window"], 600, seed=1)
    second = tmp_path / "second.kv"
    write_kinds(second, ["full_attention", "sliding_window"], 800, seed=2, prefix_of=tensors)
    return first, second


def test_put_get_gc_check_on_s3(s3_uri, pair, tmp_path):
    first, second = pair
    store = ChunkStore(open_storage(s3_uri))
    a = store.put(first, "first")
    b = store.put(second, "second")
    assert (a.chunks_new, b.chunks_shared, b.chunks_new) == (3, 2, 2)
    # two full chunks, and first's partial chunk (tokens 512-600) as the first piece of the third
    per_chunk = store.record("first").chunks[0].bytes
    assert b.chunks_pieced == 1 and b.bytes_saved == 2 * per_chunk + 88 * per_chunk // 256
    for name, path in (("first", first), ("second", second)):
        out = tmp_path / f"{name}.got.kv"
        report = store.get(name, out)
        assert out.read_bytes() == path.read_bytes()
        assert report.bytes_fetched == store.record(name).stored_bytes
    store.delete("first")
    report = store.gc()
    assert report.chunks_deleted == 1  # first's tail; its partial last chunk is second's piece
    assert store.backend.list("trash/") == []
    assert store.check().ok and store.check().orphans == 0
    out = tmp_path / "again.kv"
    store.get("second", out)
    assert out.read_bytes() == second.read_bytes()


def test_a_corrupted_chunk_on_s3_is_refused(s3_uri, pair, tmp_path, cli):
    first, _ = pair
    store = ChunkStore(open_storage(s3_uri))
    store.put(first, "first")
    digest = store.record("first").chunks[0].digest
    data = bytearray(store.backend.read_bytes(chunk_key(digest)))
    data[0] ^= 0xFF
    store.backend.write_bytes(chunk_key(digest), bytes(data))
    result = cli("store", "get", "first", "--store", s3_uri, "-o", tmp_path / "x.kv")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"chunk {digest} is corrupted" in result.stderr
    assert not (tmp_path / "x.kv").exists()


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_the_store_commands(where, request, pair, tmp_path, cli):
    uri = request.getfixturevalue("s3_uri") if where == "s3" else str(tmp_path / "store")
    first, second = pair

    def run(*args, expect=0):
        result = cli("store", *args, "--store", uri, "--format", "json")
        assert result.exit_code == expect, result.stderr
        return json.loads(result.stdout) if result.stdout else None

    put = run("put", first)
    assert put["name"] == "first" and put["bytes_saved"] == 0 and put["bytes_moved"] > put["file_bytes"] - 1000
    put = run("put", second, "--name", "turn-2")
    assert put["chunks_shared"] == 2 and put["bytes_saved"] > 0
    listed = {r["name"]: r for r in run("ls")}
    assert listed["first"]["shared_chunks"] == 3 and listed["turn-2"]["chunks"] == 4
    shown = run("inspect", "turn-2")
    # chunks 0 and 1, then chunk 2's pieces (first's partial chunk, its own rest), then chunk 3
    assert [(c["chunk"], c["shared_with"]) for c in shown["chunks"] if c["key"]] == [
        (0, 1),
        (1, 1),
        (2, 1),
        (2, 0),
        (3, 0),
    ]
    got = run("get", "turn-2", "-o", tmp_path / "t2.kv")
    assert (tmp_path / "t2.kv").read_bytes() == second.read_bytes() and got["bytes_fetched"] > 0
    assert run("check")["status"] == "OK"
    run("rm", "first")
    assert run("gc")["chunks_deleted"] == 1
    assert [r["name"] for r in run("ls")] == ["turn-2"]
    # people's output: one summary line each
    text = cli("store", "put", first, "--store", uri)
    assert text.exit_code == 0 and "moved" in text.stdout and "saved" in text.stdout
    refused = cli("store", "put", first, "--store", uri)
    assert refused.exit_code == 2 and "exists in the store; pass --force" in refused.stderr
    missing = cli("store", "get", "nope", "--store", uri)
    assert missing.exit_code == 2 and refused.stderr.count("\n") == 1


def test_concurrent_puts_deletes_and_gc_on_s3(s3_uri, tmp_path):
    """Threads putting and deleting artifacts that share a prefix while GCs run, on S3."""

    base = tmp_path / "base.kv"
    tensors = write_kinds(base, ["full_attention"], 600, seed=1)
    shared = {k: (v[..., :520, :] if v.dim() >= 2 else v[:520]) for k, v in tensors.items()}
    paths = {"base": base}
    for i in range(3):
        paths[f"turn{i}"] = tmp_path / f"turn{i}.kv"
        write_kinds(paths[f"turn{i}"], ["full_attention"], 560 + 40 * i, seed=5 + i, prefix_of=shared)
    backend = open_storage(s3_uri)
    errors = churn(backend, paths, {"turn1"}, rounds=2, collectors=1, gcs=3)
    assert not errors, errors
    store = ChunkStore(backend)
    assert sorted(store.names()) == ["base", "turn0", "turn2"]
    store.gc()
    check = store.check()
    assert check.ok and check.orphans == 0, check.problems
    for name in store.names():
        out = tmp_path / f"{name}.got.kv"
        store.get(name, out)
        assert out.read_bytes() == paths[name].read_bytes(), name
