"""Chunk pieces: a chunk built on a stored partial chunk that is a token-prefix of it stores only the
rest, so a conversation saved at every turn keeps each turn's history once; a prefix whose bytes
differ is stored whole; every turn still comes back byte-identical, through gc, check and inspect."""

from __future__ import annotations

import json

import pytest
import torch

from kvcdn_core import artifact
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.errors import ArtifactError
from kvcdn_core.store.chunkstore import ARTIFACTS, CHUNKS, PENDING, ChunkStore, chunk_key
from tests.support.storefiles import churn, conversation, write_kinds

#: 8 full-attention layers: 1 KiB of cache per token, so the cache, not the token ids, dominates
KINDS = ["full_attention"] * 8


def stored(store) -> int:
    return sum(o.size for prefix in (CHUNKS, ARTIFACTS) for o in store.backend.list(prefix))


def same(store, name, path, tmp_path) -> bool:
    out = tmp_path / f"{name}.got.kv"
    store.get(name, out)
    equal = out.read_bytes() == path.read_bytes()
    out.unlink()
    return equal


@pytest.fixture(scope="module")
def turns(tmp_path_factory):
    return conversation(tmp_path_factory.mktemp("conv"), 16)


def test_a_conversation_saved_every_turn_stores_its_history_once(turns, tmp_path):
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    reports = [store.put(p, p.stem) for p in turns]
    for path in turns:
        assert same(store, path.stem, path, tmp_path)
    final = turns[-1].stat().st_size
    assert stored(store) <= 1.3 * final, stored(store) / final
    # every turn after the first built its first new chunk on the previous turn's partial chunk
    assert all(r.chunks_pieced >= 1 for r in reports[1:])
    assert store.check().ok
    # without pieces each turn's partial last chunk is stored again inside the next turn's chunk
    whole = ChunkStore(LocalStorage(tmp_path / "whole"), pieces=False)
    for path in turns:
        whole.put(path, path.stem)
    assert stored(whole) > 1.3 * final and stored(store) < 0.75 * stored(whole)


def test_a_chunk_reuses_the_stored_chunks_pieces_and_stops_where_bytes_differ(tmp_path):
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    t1 = write_kinds(tmp_path / "t1.kv", KINDS, 300, seed=1)
    t2 = write_kinds(tmp_path / "t2.kv", KINDS, 400, seed=2, prefix_of=t1)
    write_kinds(tmp_path / "t3.kv", KINDS, 500, seed=3, prefix_of=t2)
    recomputed = {k: v.clone() for k, v in t2.items()}
    for name, t in recomputed.items():  # the last bit of one value in t2's own piece (tokens 300-400)
        if name != artifact.TOKEN_IDS:
            t.view(torch.int32)[..., 350, 0] ^= 1
    write_kinds(tmp_path / "t3b.kv", KINDS, 500, seed=4, prefix_of=recomputed)
    for name in ("t1", "t2", "t3", "t3b"):
        store.put(tmp_path / f"{name}.kv", name)
        assert same(store, name, tmp_path / f"{name}.kv", tmp_path)
    a, b, c, d = (store.record(n).chunks[1] for n in ("t1", "t2", "t3", "t3b"))
    assert a.pieces == () and a.tokens == 44
    assert [p.tokens for p in b.pieces] == [44, 100] and b.pieces[0].digest == a.digest
    # t3 takes both of t2's pieces (t2 is its longest stored prefix) and adds its own rest
    assert [p.tokens for p in c.pieces] == [44, 100, 100] and c.pieces[:2] == b.pieces
    # t3b's tokens 300-400 differ in the last bit: t1's piece is reused, t2's is not
    assert [p.tokens for p in d.pieces] == [44, 200] and d.pieces[0] == b.pieces[0]
    assert store.check().ok


def test_a_recomputed_prefix_is_stored_whole(tmp_path):
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    first = write_kinds(tmp_path / "a.kv", KINDS, 300, seed=1)
    recomputed = {k: v.clone() for k, v in first.items()}
    for name, t in recomputed.items():  # a full prefill again: the last bits of every value differ
        if name != artifact.TOKEN_IDS:
            t.view(torch.int32).bitwise_xor_(1)
    write_kinds(tmp_path / "b.kv", KINDS, 400, seed=2, prefix_of=recomputed)
    store.put(tmp_path / "a.kv", "a")
    report = store.put(tmp_path / "b.kv", "b")
    assert report.chunks_pieced == 0 and report.chunks_new == 2
    record = store.record("b")
    assert record.version == 1 and all(not c.pieces for c in record.chunks)
    assert same(store, "b", tmp_path / "b.kv", tmp_path)


def test_gc_keeps_pieces_later_turns_reference(turns, tmp_path):
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    for path in turns:
        store.put(path, path.stem)
    kept = turns[-3:]
    for path in turns[:-3]:
        store.delete(path.stem)
    report = store.gc()
    assert report.chunks_deleted > 0 and report.records == 3
    for path in kept:
        assert same(store, path.stem, path, tmp_path)
    left = {o.key for o in store.backend.list(CHUNKS)}
    assert left == {chunk_key(d) for p in kept for d in store.record(p.stem).digests}
    check = store.check()
    assert check.ok and check.orphans == 0
    # the earliest turn's pieces are still there, now only through the kept turns
    assert any(len(c.pieces) > 2 for c in store.record(kept[0].stem).chunks)


def test_a_put_marks_the_pieces_it_reuses_as_pending(turns, tmp_path):
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    store.put(turns[0], "t0")
    markers = []
    write = store.backend.write_bytes

    def spy(key, data):
        if key.startswith(PENDING):
            markers.append(json.loads(data))
        return write(key, data)

    store.backend.write_bytes = spy
    store.put(turns[1], "t1")
    record = store.record("t1")
    assert any(c.pieces for c in record.chunks)
    assert set(record.digests) == set(markers[0]["digests"])


@pytest.mark.parametrize("damage", ["missing", "corrupted"])
def test_check_and_get_find_a_damaged_piece(turns, tmp_path, damage, cli):
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    store.put(turns[0], "t0")
    store.put(turns[1], "t1")
    chunk = next(c for c in store.record("t1").chunks if c.pieces)
    digest = chunk.pieces[-1].digest  # t1's own piece: only t1 references it
    target = store.backend.path_of(chunk_key(digest))
    if damage == "missing":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[3] ^= 1
        target.write_bytes(bytes(data))
    problems = store.check().problems
    assert any(digest in p and ("missing" in p or "corrupted" in p) for p in problems), problems
    with pytest.raises(ArtifactError, match=f"chunk {digest} is {damage}"):
        store.get("t1", tmp_path / "out.kv")
    assert not (tmp_path / "out.kv").exists()
    assert same(store, "t0", turns[0], tmp_path)
    result = cli("store", "check", "--store", tmp_path / "store")
    assert result.exit_code == 1 and digest in result.stdout


def test_inspect_and_ls_show_pieces_and_what_they_share(turns, tmp_path, cli):
    uri = tmp_path / "store"
    for path in turns[:2]:
        assert cli("store", "put", path, "--store", uri).exit_code == 0
    store = ChunkStore(LocalStorage(uri))
    record = store.record("turn01")
    i = next(i for i, c in enumerate(record.chunks) if c.pieces)
    shown = json.loads(cli("store", "inspect", "turn01", "--store", uri, "--format", "json").stdout)
    rows = [r for r in shown["chunks"] if r["chunk"] == i]
    assert [r["tokens"][1] - r["tokens"][0] for r in rows] == [p.tokens for p in record.chunks[i].pieces]
    assert [r["shared_with"] for r in rows] == [1, 0]  # turn00's partial chunk, then turn01's rest
    assert shown["shared_chunks"] == i + 1  # the full chunks before it, and it through its piece
    listed = {r["name"]: r for r in json.loads(cli("store", "ls", "--store", uri, "--format", "json").stdout)}
    assert listed["turn00"]["shared_chunks"] == len(store.record("turn00").chunks)
    table = cli("store", "inspect", "turn01", "--store", uri)
    assert table.exit_code == 0 and table.stdout.count("\n") == len(shown["chunks"]) + 3


def test_concurrent_puts_deletes_and_gcs_of_turns_that_share_pieces(turns, tmp_path):
    """Each turn's put builds on whichever earlier turn is stored at that moment, while others are
    deleted and collected: every turn left comes back byte-identical, and nothing is left over."""
    backend = LocalStorage(tmp_path / "store")
    paths = {p.stem: p for p in turns[:6]}
    deleted = {"turn01", "turn03"}
    errors = churn(backend, paths, deleted)
    assert not errors, errors
    store = ChunkStore(backend)
    assert sorted(store.names()) == sorted(set(paths) - deleted)
    for name in store.names():
        assert same(store, name, paths[name], tmp_path), name
    check = store.check()
    assert check.ok, check.problems
    store.gc()
    assert store.check().orphans == 0
    for name in store.names():
        assert same(store, name, paths[name], tmp_path), name


def test_a_turn_put_again_after_later_turns_stores_nothing_new(tmp_path):
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    t1 = write_kinds(tmp_path / "t1.kv", KINDS, 300, seed=1)
    write_kinds(tmp_path / "t2.kv", KINDS, 400, seed=2, prefix_of=t1)
    store.put(tmp_path / "t1.kv", "t1")
    store.put(tmp_path / "t2.kv", "t2")
    store.delete("t1")
    store.gc()
    objects = {o.key for o in store.backend.list(CHUNKS)}
    # t1's partial chunk (tokens 256-300) is t2's first piece: t1 finds it whole
    again = store.put(tmp_path / "t1.kv", "t1-again")
    assert (again.chunks_new, again.chunks_pieced) == (0, 0)
    # t2 under another name: its pieced chunk is the same two pieces
    copy = store.put(tmp_path / "t2.kv", "t2-copy")
    assert (copy.chunks_new, copy.chunks_pieced) == (0, 1)
    assert {o.key for o in store.backend.list(CHUNKS)} - objects == {chunk_key(store.record("t1-again").tail.digest)}
    assert same(store, "t1-again", tmp_path / "t1.kv", tmp_path) and same(
        store, "t2-copy", tmp_path / "t2.kv", tmp_path
    )


def test_a_put_reads_and_hashes_each_byte_once_and_only_new_objects_again(tmp_path, monkeypatch):
    """A turn sharing the previous turn's chunks: cutting it reads and hashes every byte once, and
    the one chunk with a new rest piece once more whole (is it stored already?); the upload reads
    and hashes only the objects the store lacks, and ``verified`` skips the manifest check's pass
    over every byte."""
    from kvcdn_core.artifact import digests
    from kvcdn_core.store import pack

    store = ChunkStore(LocalStorage(tmp_path / "store"))
    t1 = write_kinds(tmp_path / "t1.kv", KINDS, 600, seed=1)
    write_kinds(tmp_path / "t2.kv", KINDS, 700, seed=2, prefix_of=t1)
    store.put(tmp_path / "t1.kv", "t1")
    hashed, gathered, checked = [0], [0], [0]
    digest_of, rows, hexdigest = pack.digest_of, pack.Cutter.rows, digests.hexdigest

    def count_hash(data):
        hashed[0] += len(data)
        return digest_of(data)

    def count_rows(self, t0, t1):
        data = rows(self, t0, t1)
        gathered[0] += len(data)
        return data

    def count_check(algorithm, data, threads=1):
        checked[0] += memoryview(data).nbytes
        return hexdigest(algorithm, data, threads)

    monkeypatch.setattr(pack, "digest_of", count_hash)
    monkeypatch.setattr(pack.Cutter, "rows", count_rows)
    monkeypatch.setattr(digests, "hexdigest", count_check)
    for name, verified in (("t2", False), ("t2-verified", True)):
        hashed[0] = gathered[0] = checked[0] = 0
        report = store.put(tmp_path / "t2.kv", name, verified=verified)
        record = store.record(name)
        chunked = sum(c.bytes for c in record.chunks)
        new = report.bytes_moved - len(record.to_json())  # the objects uploaded (the record aside)
        assert record.chunks[2].pieces  # tokens 512-700: t1's piece (512-600), then the new rest
        rest = record.chunks[2].pieces[-1].bytes
        # t2: its rest piece and tail are new; t2 again: nothing is
        assert new == (rest + record.tail.bytes if name == "t2" else 0)
        whole = record.chunks[2].bytes if name == "t2" else 0  # t2 again: its pieces cover the chunk
        assert gathered[0] == chunked + (rest if new else 0) + whole
        assert hashed[0] == record.stored_bytes + new + whole
        assert checked[0] == (0 if verified else record.stored_bytes)  # the data region is the tensors
        assert same(store, name, tmp_path / "t2.kv", tmp_path)


def test_a_chunk_the_store_holds_whole_is_not_stored_again_as_pieces(tmp_path):
    """Pieces save bytes only: when a turn's chunk could be t1's piece plus a new rest, but the
    store holds the chunk's whole bytes already (here left by a deleted artifact, not yet
    collected), the chunk references the whole object and the put writes no new chunk bytes."""
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    t1 = write_kinds(tmp_path / "t1.kv", KINDS, 300, seed=1)
    write_kinds(tmp_path / "t2.kv", KINDS, 400, seed=2, prefix_of=t1)
    store.put(tmp_path / "t2.kv", "t2")
    whole = store.record("t2").chunks[1]
    store.delete("t2")
    store.put(tmp_path / "t1.kv", "t1")
    objects = {o.key for o in store.backend.list(CHUNKS)}
    report = store.put(tmp_path / "t2.kv", "t2-again")
    assert {o.key for o in store.backend.list(CHUNKS)} == objects  # no rest piece written
    assert report.chunks_pieced == 0 and store.record("t2-again").chunks[1] == whole
    assert same(store, "t2-again", tmp_path / "t2.kv", tmp_path)
