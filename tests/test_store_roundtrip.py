"""The chunk store packs any `.kv` file and gives back the same bytes: every layer kind, quantized
int8/int4, format versions 1 and 2; a shared prefix is stored once; a corrupted chunk is refused."""

from __future__ import annotations

import json
import threading

import pytest

from kvcdn_core import artifact
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.store import chunkstore, keys
from kvcdn_core.store.chunkstore import ChunkStore, chunk_key, record_key
from kvcdn_core.store.record import ArtifactRecord
from tests.support import kvfiles
from tests.support.storefiles import KINDS, write_kinds

#: 2 full chunks and a partial one
TOKENS = 600


@pytest.fixture
def store(tmp_path):
    return ChunkStore(LocalStorage(tmp_path / "store"))


def round_trip(store, path, tmp_path, name="a"):
    report = store.put(path, name)
    out = tmp_path / f"{name}.out.kv"
    got = store.get(name, out)
    assert out.read_bytes() == path.read_bytes()
    assert got.file_bytes == path.stat().st_size
    return report, store.record(name)


#: kinds whose per-token tensors are cut (artifact.CROPPABLE_KINDS); the others go whole to the tail
CHUNKED = set(artifact.CROPPABLE_KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_layer_kind_round_trips_byte_identical(store, tmp_path, kind):
    path = tmp_path / f"{kind}.kv"
    write_kinds(path, [kind], TOKENS)
    report, record = round_trip(store, path, tmp_path)
    if kind in CHUNKED:
        # per-token tensors are cut: 256 + 256 + 88 tokens; the states and token ids are the tail
        assert [c.tokens for c in record.chunks] == [256, 256, 88]
        assert report.chunks == 3 and report.chunks_new == 3
        expected = {n for n, e in artifact.read_header(path).entries.items() if e["shape"][-2:-1] == [TOKENS]}
        assert set(record.chunked) == expected - {artifact.TOKEN_IDS}
    else:
        # a sliding window or a state is a snapshot of the whole prefix: whole, in the tail
        assert record.chunks == () and record.chunked == ()
    assert record.tail is not None


def test_a_hybrid_artifact_of_every_kind_round_trips(store, tmp_path):
    path = tmp_path / "all.kv"
    write_kinds(path, sorted(KINDS), TOKENS)
    _, record = round_trip(store, path, tmp_path)
    assert record.reuse == "whole_prefix" and len(record.chunks) == 3


@pytest.mark.parametrize("tokens", [1, 255, 256, 257, 512])
def test_chunk_boundaries(store, tmp_path, tokens):
    path = tmp_path / "b.kv"
    write_kinds(path, ["full_attention"], tokens)
    _, record = round_trip(store, path, tmp_path)
    ids = artifact.read_token_ids(path)
    assert [c.key for c in record.chunks] == keys.chain(record.root, ids)
    assert sum(c.tokens for c in record.chunks) == tokens


def test_format_1_file_round_trips_unchanged(store, tmp_path):
    v2 = tmp_path / "v2.kv"
    write_kinds(v2, ["full_attention"], TOKENS)
    v1 = tmp_path / "v1.kv"
    v1.write_bytes(kvfiles.as_format_1(v2.read_bytes()))
    _, record = round_trip(store, v1, tmp_path, "v1")
    assert artifact.read_header(tmp_path / "v1.out.kv").format_version == 1
    # the header is kept verbatim; the tensor bytes are the same, so the chunks are shared with v2
    report = store.put(v2, "v2")
    assert report.chunks_shared == 3 and report.chunks_new == 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_artifact_round_trips_as_one_tail(store, tmp_path, cli, scheme):
    source = tmp_path / "src.kv"
    write_kinds(source, ["full_attention"], TOKENS)
    out = tmp_path / f"{scheme}.kv"
    result = cli("quant", "--kv-path", source, "--scheme", scheme, "-o", out)
    assert result.exit_code == 0, result.stderr
    _, record = round_trip(store, out, tmp_path, scheme)
    assert record.chunks == () and record.tail.bytes == out.stat().st_size - artifact.read_header(out).data_start


def test_an_artifact_continued_from_a_shared_prefix_stores_the_prefix_once(store, tmp_path):
    first = tmp_path / "first.kv"
    tensors = write_kinds(first, ["full_attention", "mla_latent"], 520, seed=1)
    second = tmp_path / "second.kv"
    write_kinds(second, ["full_attention", "mla_latent"], 700, seed=2, prefix_of=tensors)
    a = store.put(first, "first")
    b = store.put(second, "second")
    assert (a.chunks, a.chunks_new) == (3, 3)
    # the two full chunks of the shared 520 tokens are the same bytes; the third is first's partial
    # chunk (tokens 512-520) as a piece, then a new piece of the rest
    assert (b.chunks, b.chunks_shared, b.chunks_new, b.chunks_pieced) == (3, 2, 1, 1)
    per_chunk = store.record("first").chunks[0].bytes
    assert b.bytes_saved == 2 * per_chunk + 8 * per_chunk // 256
    third = store.record("second").chunks[2]
    assert third.digest is None and [p.tokens for p in third.pieces] == [8, 180]
    assert third.pieces[0].digest == store.record("first").chunks[2].digest
    rows = {r.name: r for r in store.listing()}
    assert rows["first"].shared_chunks == 3 and rows["second"].shared_chunks == 3
    for name, path in (("first", first), ("second", second)):
        store.get(name, tmp_path / f"{name}.got.kv")
        assert (tmp_path / f"{name}.got.kv").read_bytes() == path.read_bytes()
    chunk_objects = [o for o in store.backend.list("chunks/")]
    assert len(chunk_objects) == 3 + 1 + 2  # first's 3 chunks, second's new piece, 2 tails


@pytest.mark.parametrize("settled", [None, 288])
def test_rows_past_the_settled_point_are_a_piece_of_their_own(store, tmp_path, settled):
    """A vLLM save: the next turn recomputes the rows of a prompt's last, partial block (here
    288-300), to other bits; cut there, the rows before it are still referenced."""
    first = tmp_path / "first.kv"
    tensors = write_kinds(first, ["full_attention"], 300, seed=1)
    store.put(first, "first", settled=settled)
    last = store.record("first").chunks[1]
    if settled:
        assert last.digest is None and [p.tokens for p in last.pieces] == [32, 12]
    recomputed = {name: t.clone() for name, t in tensors.items()}
    for role in ("key", "value"):
        recomputed[f"layers.0.{role}"][..., 288:300, :] += 1e-6
    second = tmp_path / "second.kv"
    write_kinds(second, ["full_attention"], 400, seed=2, prefix_of=recomputed)
    report = store.put(second, "second", settled=384 if settled else None)
    chunk = store.record("second").chunks[1]
    per_token = store.record("first").chunks[0].bytes // 256
    if settled:  # 256-288 referenced, then 288-384 and 384-400 new
        assert chunk.pieces[0].digest == last.pieces[0].digest
        assert [p.tokens for p in chunk.pieces] == [32, 96, 16]
        assert report.bytes_saved == (256 + 32) * per_token
    else:  # the stored chunk's rows differ past 288: the chunk is new, whole
        assert chunk.digest is not None
        assert report.bytes_saved == 256 * per_token
    for name, path in (("first", first), ("second", second)):
        store.get(name, tmp_path / f"{name}.got.kv")
        assert (tmp_path / f"{name}.got.kv").read_bytes() == path.read_bytes()


def test_a_settled_point_does_not_cut_a_chunk_the_store_holds_whole(store, tmp_path):
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], 300, seed=1)
    store.put(path, "a")
    report = store.put(path, "b", settled=288)
    assert store.record("b").chunks == store.record("a").chunks and report.chunks_new == 0


def test_a_corrupted_chunk_is_refused_on_get(store, tmp_path, cli):
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    store.put(path, "a")
    digest = store.record("a").chunks[1].digest
    target = store.backend.path_of(chunk_key(digest))
    data = bytearray(target.read_bytes())
    data[5] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"chunk {digest} is corrupted"):
        store.get("a", tmp_path / "out.kv")
    assert not (tmp_path / "out.kv").exists()
    result = cli("store", "get", "a", "--store", tmp_path / "store", "-o", tmp_path / "out.kv")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "corrupted" in result.stderr
    assert not (tmp_path / "out.kv").exists()
    checked = cli("store", "check", "--store", tmp_path / "store", "--format", "json")
    assert checked.exit_code == 1
    assert any(digest in p for p in json.loads(checked.stdout)["problems"])


def test_a_missing_chunk_is_refused_and_reported(store, tmp_path, cli):
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    store.put(path, "a")
    digest = store.record("a").chunks[0].digest
    store.backend.delete(chunk_key(digest))
    with pytest.raises(ArtifactError, match=f"chunk {digest} is missing"):
        store.get("a", tmp_path / "out.kv")
    assert any("references missing chunk" in p for p in store.check().problems)


def test_a_put_refuses_a_corrupted_file_and_stores_nothing(store, tmp_path):
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="mismatch"):
        store.put(path, "a")
    assert store.backend.list("") == []


def test_names_and_overwrite(store, tmp_path):
    path = tmp_path / "doc.kv"
    write_kinds(path, ["full_attention"], 10)
    assert store.put(path).name == "doc"
    with pytest.raises(KvcdnError, match="exists in the store; pass --force"):
        store.put(path)
    assert store.put(path, force=True).chunks_new == 0
    for bad in ("../x", ".hidden", "a/b", "", "x" * 200):
        with pytest.raises(KvcdnError, match="invalid artifact name"):
            store.put(path, bad)


def test_a_record_that_lies_about_its_chunks_is_refused(store, tmp_path):
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    store.put(path, "a")
    record = json.loads(store.backend.read_bytes(record_key("a")))
    record["chunks"][0]["tokens"] = 255
    store.backend.write_bytes(record_key("a"), json.dumps(record).encode())
    with pytest.raises(ArtifactError, match="chunks do not cut token_count"):
        store.get("a", tmp_path / "out.kv")


def test_a_record_is_parsed_again_only_when_its_bytes_change(store, tmp_path, monkeypatch):
    # an engine's scheduler reads the hit's record at every request: the same bytes are parsed once,
    # and a record rewritten in place (a put with --force, damage) is taken as it is now
    monkeypatch.setattr(chunkstore, "KEPT_RECORDS", 1)
    parsed: list[str] = []
    real = ArtifactRecord.from_json
    monkeypatch.setattr(
        ArtifactRecord, "from_json", staticmethod(lambda data, where: parsed.append(where) or real(data, where))
    )
    for name, tokens in (("a", TOKENS), ("b", TOKENS + 3)):
        write_kinds(tmp_path / f"{name}.kv", ["full_attention"], tokens)
        store.put(tmp_path / f"{name}.kv", name)
    first, count = store.record("a"), len(parsed)
    assert store.record("a") is first and len(parsed) == count
    write_kinds(tmp_path / "a.kv", ["full_attention"], TOKENS + 5)
    store.put(tmp_path / "a.kv", "a", force=True)
    again = store.record("a")
    assert again is not first and again.token_count == TOKENS + 5
    store.record("b")  # one record kept: b pushes a out, and a is parsed anew
    count = len(parsed)
    assert store.record("a") is not again and len(parsed) == count + 1
    store.backend.write_bytes(record_key("a"), b"{}")
    with pytest.raises(ArtifactError, match="record 'a'"):
        store.record("a")


def test_records_read_by_threads_while_one_is_rewritten_are_each_as_stored(store, tmp_path, monkeypatch):
    monkeypatch.setattr(chunkstore, "KEPT_RECORDS", 2)  # three names through two places: evictions too
    versions: dict[str, set[bytes]] = {}
    for name, tokens in (("a", TOKENS), ("b", TOKENS + 3), ("c", TOKENS + 7)):
        write_kinds(tmp_path / f"{name}.kv", ["full_attention"], tokens)
        store.put(tmp_path / f"{name}.kv", name)
        versions[name] = {store.backend.read_bytes(record_key(name))}
    write_kinds(tmp_path / "a2.kv", ["full_attention"], TOKENS + 11)
    seen: list[tuple[str, object]] = []
    failures: list[BaseException] = []

    def read(names):
        try:
            for _ in range(40):
                for name in names:
                    seen.append((name, store.record(name)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=read, args=(order,)) for order in ("abc", "cba", "bca")]
    for t in threads:
        t.start()
    for _ in range(3):
        store.put(tmp_path / "a2.kv", "a", force=True)
        versions["a"].add(store.backend.read_bytes(record_key("a")))
        store.put(tmp_path / "a.kv", "a", force=True)
    for t in threads:
        t.join()
    assert not failures and len(seen) == 3 * 40 * 3
    parsed = {name: [ArtifactRecord.from_json(v, "check") for v in vs] for name, vs in versions.items()}
    for name, record in seen:
        assert any(record.to_json() == p.to_json() for p in parsed[name])
    assert {r.token_count for name, r in seen if name == "a"} <= {TOKENS, TOKENS + 11}


def test_token_ids_come_from_the_tail(store, tmp_path):
    path = tmp_path / "a.kv"
    write_kinds(path, ["sliding_window", "full_attention"], TOKENS)
    store.put(path, "a")
    assert store.token_ids("a") == artifact.read_token_ids(path)


#: Measured in a process of its own: tracemalloc counts every thread's allocations, and the test
#: process may hold servers from other tests whose threads allocate meanwhile.
_MEASURE_PUT_AND_GET = """
import json, sys, tracemalloc
from pathlib import Path
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.store.chunkstore import ChunkStore
path, root, out = map(Path, sys.argv[1:4])
warm = ChunkStore(LocalStorage(root / "warm"))  # the lazy imports happen here, not while measured
warm.put(path, "big")
warm.get("big", out)
store = ChunkStore(LocalStorage(root / "measured"))
tracemalloc.start()
store.put(path, "big")
_, put_peak = tracemalloc.get_traced_memory()
tracemalloc.reset_peak()
store.get("big", out)
_, get_peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
print(json.dumps({"put": put_peak, "get": get_peak, "chunk": store.record("big").chunks[0].bytes}))
"""


def test_put_and_get_hold_about_one_chunk_in_memory(tmp_path):
    """A 4,096-token artifact of 16 MB goes in and out holding a few 1 MB chunks at most (the file
    is read through a memory map and rebuilt in place), not the whole file."""
    import subprocess
    import sys

    import torch

    tokens = 4096
    path = tmp_path / "big.kv"
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-12-01T00:00:00+00:00",
        "model": {"id": "example/tiny", "architecture": "Qwen3ForCausalLM"},
        "compute_dtype": "float32",
        "layers": [{"index": 0, "kind": "full_attention", "tensors": {"key": "k", "value": "v"}}],
        "quantization": None,
    }
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(1, 8, tokens, 64, generator=gen) for n in ("k", "v")}
    artifact.write_artifact(path, manifest, {**tensors, artifact.TOKEN_IDS: torch.arange(tokens)})
    del tensors
    size = path.stat().st_size
    out = tmp_path / "out.kv"
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE_PUT_AND_GET, str(path), str(tmp_path / "store"), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    peaks = json.loads(run.stdout)
    chunk = peaks["chunk"]
    assert chunk == 1 << 20 and size > 16 * chunk
    assert out.read_bytes() == path.read_bytes()
    assert peaks["put"] < 4 * chunk and peaks["get"] < 4 * chunk, peaks
    assert (tmp_path / "out.kv").read_bytes() == path.read_bytes()


def test_check_finds_chunk_keys_that_are_not_the_token_ids(store, tmp_path):
    """The prefix index trusts a record's keys: check recomputes them from the header and the ids."""
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    store.put(path, "a")
    assert store.check().ok
    record = json.loads(store.backend.read_bytes(record_key("a")))
    record["chunks"][0]["key"], record["chunks"][1]["key"] = record["chunks"][1]["key"], record["chunks"][0]["key"]
    store.backend.write_bytes(record_key("a"), json.dumps(record).encode())
    assert store.check().problems == ["artifact 'a': its chunk keys are not those of its token ids"]
    record["chunks"][0]["key"], record["chunks"][1]["key"] = record["chunks"][1]["key"], record["chunks"][0]["key"]
    record["root"] = "0" * 64
    store.backend.write_bytes(record_key("a"), json.dumps(record).encode())
    assert store.check().problems == ["artifact 'a': its root key is not that of its model and representation"]


def test_a_record_whose_model_is_not_its_headers_is_refused(store, tmp_path):
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    store.put(path, "a")
    record = json.loads(store.backend.read_bytes(record_key("a")))
    record["model"]["id"] = "someone/else"
    store.backend.write_bytes(record_key("a"), json.dumps(record).encode())
    with pytest.raises(ArtifactError, match="model differs from the header's"):
        store.record("a")


def test_put_and_delete_keep_the_prefix_index(store, tmp_path):
    """put adds the artifact to the prefix index with its token ids, a forced put replaces its
    entries, and delete removes them: a lookup by the artifact's own tokens finds it, then not."""
    from kvcdn_core.store import index

    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    ids = artifact.read_token_ids(path)

    def found() -> list[tuple[str, int]]:
        return [(hit.name, hit.prefix_tokens) for hit in index.lookup(store.backend, root, ids + [1])]

    store.put(path, "a")
    root = store.record("a").root
    assert found() == [("a", len(ids))]
    store.put(path, "a", force=True)
    assert found() == [("a", len(ids))]  # replaced, not doubled
    store.delete("a")
    assert found() == []


def test_a_header_with_any_text_comes_back_byte_identical(store, tmp_path):
    """The record keeps the header as JSON text inside JSON: quotes, backslashes, control
    characters and non-ASCII text survive, and so does the header's padding."""
    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], 300, context='h\u00e9llo \u65e5\u672c "q" \\ \n\t\x01 \U0001f600 ')
    round_trip(store, path, tmp_path)


def test_check_repair_rebuilds_a_lost_index(store, tmp_path):
    """A put that died after its record but before its index entry: `store check --repair` finds it again."""
    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli
    from kvcdn_core.store import index

    path = tmp_path / "a.kv"
    write_kinds(path, ["full_attention"], TOKENS)
    ids = artifact.read_token_ids(path)
    store.put(path, "a")
    root = store.record("a").root
    for info in store.backend.list("index/"):  # the index entry is lost, the record stays
        store.backend.delete(info.key)
    assert index.lookup(store.backend, root, ids + [1]) == []
    result = CliRunner().invoke(make_cli(), ["store", "check", "--store", str(store.backend.root), "--repair"])
    assert result.exit_code == 0, result.output
    assert "prefix index rebuilt: 1 artifact(s)" in result.stderr
    assert [hit.name for hit in index.lookup(store.backend, root, ids + [1])] == ["a"]
