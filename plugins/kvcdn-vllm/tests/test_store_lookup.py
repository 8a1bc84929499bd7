"""The connector's chunk-store side without vLLM: a prompt looked up in a real store's prefix index,
the load plan and the tensors its chunks rebuild, a store that fails being a miss, and the save
queue (only new chunks put, back pressure, and a run of failures as one warning line)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from kvcdn_vllm import lookup, saver
from kvcdn_vllm.catalog import ModelShape, check_fits
from kvcdn_vllm.saver import SaveQueue, SaveTarget
from kvcdn_vllm.tier import REMOTE, ChunkTier
from kvcdn_vllm.writer import SavedModel

from kvcdn_core import artifact
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.store import index as store_index
from kvcdn_core.store.chunkstore import ChunkStore
from tests.support.storefiles import layer_pieces, write_kinds

#: the model of tests.support.storefiles' artifacts, as an engine would fingerprint it
FINGERPRINT = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": None}
ROOT = lookup.engine_root(FINGERPRINT, "float32")


@pytest.fixture
def store(tmp_path):
    return ChunkStore(LocalStorage(tmp_path / "store"))


def put(store, tmp_path, name, tokens, prefix_of=None, seed=0):
    path = tmp_path / f"{name}.kv"
    tensors = write_kinds(path, ["full_attention"] * 3, tokens, seed=seed, prefix_of=prefix_of)
    return tensors, store.put(path, name)


def test_a_prompt_finds_its_longest_stored_prefix_and_the_plan_rebuilds_its_tokens(store, tmp_path):
    tensors, _ = put(store, tmp_path, "doc", 700)
    ids = tensors[artifact.TOKEN_IDS].tolist()
    prompt = ids[:600] + [7, 8, 9]
    warnings: list[str] = []
    finder = lookup.StoreLookup(store, ROOT, warnings.append)
    match = finder.lookup(prompt)
    assert match is not None and (match.name, match.prefix_tokens) == ("doc", 600)
    check_fits(match.record.parsed_header(), ModelShape(3, 2, 8), hashes=False)
    plan = lookup.plan(match.record, 128, 512)
    assert [(p.start, p.tokens) for p in plan.parts] == [(0, 256), (256, 256)]  # the chunks holding them
    tier = ChunkTier(finder.fetch, 1 << 20, 0, None, warnings.append)
    got = [(p, tier.get(p.digest, p.bytes)[0]) for p in plan.parts]
    out = lookup.slices(plan, got, 128, 512)
    for i in range(3):
        for role in ("key", "value"):
            name = f"layers.{i}.{role}"
            assert torch.equal(out[name], tensors[name][0, :, 128:512])
    assert warnings == []


def test_another_model_or_dtype_finds_nothing_and_a_failing_store_is_a_miss(store, tmp_path):
    tensors, _ = put(store, tmp_path, "doc", 300)
    prompt = tensors[artifact.TOKEN_IDS].tolist()
    other = lookup.engine_root({**FINGERPRINT, "config_sha256": "d" * 64}, "float32")
    assert lookup.StoreLookup(store, other, print).lookup(prompt) is None
    assert lookup.StoreLookup(store, lookup.engine_root(FINGERPRINT, "bfloat16"), print).lookup(prompt) is None

    class Down(LocalStorage):
        def list(self, prefix=""):
            raise ConnectionError("store unreachable\nsecond line")

    warnings: list[str] = []
    finder = lookup.StoreLookup(ChunkStore(Down(tmp_path / "store")), ROOT, warnings.append)
    assert finder.lookup(prompt) is None and finder.lookup(prompt) is None
    assert warnings == ["prefix lookup in the store failed: store unreachable"]  # one line, once


class CountingStorage(LocalStorage):
    """A local store that counts the index objects read (not the change mark) and the listings."""

    index_reads = 0
    listings = 0

    def read_bytes(self, key):
        if key.startswith("index/") and key != store_index.MARK:
            CountingStorage.index_reads += 1
        return super().read_bytes(key)

    def list(self, prefix=""):
        CountingStorage.listings += 1
        return super().list(prefix)


def test_warm_reads_the_index_at_start_so_the_first_lookup_reads_only_what_is_new(tmp_path, monkeypatch):
    monkeypatch.setattr(store_index, "RELIST_S", float("inf"))  # a slow machine's seconds list nothing either
    backend = CountingStorage(tmp_path / "store")
    writer = ChunkStore(LocalStorage(tmp_path / "store"))
    tensors, _ = put(writer, tmp_path, "doc", 300)
    put(writer, tmp_path, "other", 300, seed=1)
    prompt = tensors[artifact.TOKEN_IDS].tolist()
    warnings: list[str] = []

    cold = lookup.StoreLookup(ChunkStore(CountingStorage(tmp_path / "store")), ROOT, warnings.append)
    CountingStorage.index_reads = 0
    assert cold.lookup(prompt) is not None
    assert CountingStorage.index_reads == 2  # without warm: the first request reads every index object

    warmed = lookup.StoreLookup(ChunkStore(backend), ROOT, warnings.append)
    CountingStorage.index_reads = 0
    warmed.warm()
    assert CountingStorage.index_reads == 2
    CountingStorage.listings = 0
    match = warmed.lookup(prompt)
    assert match is not None and match.name == "doc" and CountingStorage.index_reads == 2  # none read again
    assert CountingStorage.listings == 0  # the change mark is as warm() left it: nothing listed
    put(writer, tmp_path, "third", 300, seed=2)
    assert warmed.lookup(prompt) is not None and CountingStorage.index_reads == 3  # only the new one
    assert CountingStorage.listings == 2  # the put changed the mark: the index's two folders listed

    class Down(LocalStorage):
        def list(self, prefix=""):
            raise ConnectionError("store unreachable")

    down = lookup.StoreLookup(ChunkStore(Down(tmp_path / "store")), ROOT, warnings.append)
    down.warm()  # nothing raised, nothing said: the first lookup says it
    assert warnings == []
    assert down.lookup(prompt) is None
    assert warnings == ["prefix lookup in the store failed: store unreachable"]


def saves_to(store_dir, model_dir="no-model", fingerprint=FINGERPRINT) -> SaveTarget:
    """Where a test's save queue puts: a local chunk store, an engine of ``fingerprint``."""
    return SaveTarget(str(store_dir), SavedModel("example/tiny", None, str(model_dir), fingerprint, None))


def test_saves_put_only_new_chunks_from_a_process_of_their_own(store, tmp_path):
    """The queue hands a prompt's pieces over in shared memory; the save process joins them, writes
    the artifact and puts only the chunks the store lacks; the store gives the tensors back bitwise."""
    first, _ = put(store, tmp_path, "turn1", 512, seed=1)
    second = write_kinds(tmp_path / "turn2.kv", ["full_attention"] * 3, 700, seed=2, prefix_of=first)
    done = []
    warnings: list[str] = []
    saver = SaveQueue(saves_to(store.backend.root), 2, warnings.append, lambda name, report: done.append(report))
    assert saver.save("turn2", second[artifact.TOKEN_IDS].tolist(), layer_pieces(second, cuts=(100, 512)))
    saver.join()
    (report,) = done
    assert (report.chunks, report.chunks_new) == (3, 1)  # the two chunks of turn 1 were there
    assert lookup.StoreLookup(store, ROOT, print).lookup(first[artifact.TOKEN_IDS].tolist() + [1]).prefix_tokens == 512
    store.get("turn2", tmp_path / "back.kv")
    back = artifact.load_tensors(artifact.read_header(tmp_path / "back.kv"))
    assert back.keys() == second.keys()
    assert all(torch.equal(back[name], t) for name, t in second.items())
    saver.close()
    assert warnings == [] and saver.saved == 1


def test_a_save_cuts_its_last_chunk_where_the_prompts_last_partial_block_starts(store, tmp_path):
    """vLLM recomputes a prompt's last, partial block in the next turn: the save process puts with
    ``settled`` at its start (700 tokens, blocks of 128: 640), so that turn can reference the rest."""
    tensors = write_kinds(tmp_path / "turn.kv", ["full_attention"] * 2, 700, seed=3)
    done = []
    target = dataclasses.replace(saves_to(store.backend.root), block_size=128)
    saver = SaveQueue(target, 2, print, lambda name, report: done.append(report))
    assert saver.save("turn", tensors[artifact.TOKEN_IDS].tolist(), layer_pieces(tensors))
    saver.join()
    saver.close()
    last = store.record("turn").chunks[-1]
    assert last.digest is None and [p.tokens for p in last.pieces] == [128, 60]
    store.get("turn", tmp_path / "back.kv")
    back = artifact.load_tensors(artifact.read_header(tmp_path / "back.kv"))
    assert all(torch.equal(back[name], t) for name, t in tensors.items())


def test_the_save_process_puts_without_checking_the_file_it_has_just_written(store, tmp_path, monkeypatch):
    """The save process hashed each tensor once as it wrote the file: its put cuts the file without
    checking it against its manifest again (run here on a thread, so that the checks can be counted)."""
    import os
    import socket
    from multiprocessing.connection import Connection
    from multiprocessing.reduction import send_handle

    from kvcdn_core.store import pack

    first, _ = put(store, tmp_path, "turn1", 300, seed=1)
    second = write_kinds(tmp_path / "turn2.kv", ["full_attention"] * 3, 450, seed=2, prefix_of=first)
    checks = []
    check = pack.Cutter.check_digests
    monkeypatch.setattr(pack.Cutter, "check_digests", lambda self: checks.append(1) or check(self))
    ours, theirs = (Connection(s.detach()) for s in socket.socketpair())
    process = threading.Thread(target=saver._serve, args=(theirs,))
    process.start()
    ours.send(saves_to(store.backend.root))
    handover = saver.Handover(7, "turn2", saver.Arena(1 << 20))
    for index, pieces in layer_pieces(second).items():
        for keys, values in pieces:
            handover.copy(index, keys, values)
    ours.send(handover.job(second[artifact.TOKEN_IDS].tolist()))
    send_handle(ours, handover.arena.fd, os.getpid())
    seq, outcome, report = ours.recv()
    ours.send(None)
    process.join()
    handover.arena.close()
    assert (seq, outcome, report.chunks_pieced) == (7, "saved", 1)  # turn 1's partial chunk, then the new rest
    assert checks == []
    store.put(tmp_path / "turn1.kv", "turn1-again", force=True)  # a file from elsewhere: checked
    assert checks == [1]


def test_a_full_queue_skips_and_failed_saves_are_one_line(tmp_path):
    """``capacity`` saves in flight: the next is skipped at once (the save process is stopped, so the
    first cannot finish meanwhile). A store that cannot take saves (its path is a file) fails each
    save; the first failure is one line, the rest are counted."""
    import os
    import signal

    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"not a directory")
    tensors = write_kinds(tmp_path / "p.kv", ["full_attention"] * 2, 40, seed=3)
    ids, pieces = tensors[artifact.TOKEN_IDS].tolist(), layer_pieces(tensors)
    warnings: list[str] = []
    saver = SaveQueue(saves_to(blocked), 1, warnings.append)
    pid = saver._process.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert saver.save("a", ids, pieces)
        assert not saver.save("b", ids, pieces)  # one in flight already: skipped, the caller never waits
    finally:
        os.kill(pid, signal.SIGCONT)
    saver.join()
    assert saver.save("c", ids, pieces)
    saver.join()
    assert len(warnings) == 2
    assert warnings[0] == "not saving b: 1 saves are already waiting for the store"
    assert warnings[1].startswith("not saving a: ") and warnings[1].endswith(
        "(saves that fail after this one are counted, not logged, until one works again)"
    )  # c failed too: counted, not logged
    assert (saver.saved, saver.skipped, saver.failed) == (0, 1, 2)
    saver.close()


def test_a_killed_save_process_costs_what_it_held_and_the_next_save_starts_another(store, tmp_path):
    import os
    import signal

    tensors = write_kinds(tmp_path / "p.kv", ["full_attention"] * 3, 300, seed=4)
    ids, pieces = tensors[artifact.TOKEN_IDS].tolist(), layer_pieces(tensors)
    warnings: list[str] = []
    saver = SaveQueue(saves_to(store.backend.root), 2, warnings.append)
    first = saver._process.proc.pid
    os.kill(first, signal.SIGSTOP)  # it holds the save and cannot answer
    assert saver.save("lost", ids, pieces)
    os.kill(first, signal.SIGKILL)
    saver.join()
    assert warnings == [
        "the save process stopped (exit code -9); 1 saves it held were not saved; the next save starts a new process"
    ]
    assert saver.save("kept", ids, pieces)
    saver.join()
    assert saver._process.proc.pid != first
    assert (saver.saved, saver.failed) == (1, 1)
    assert [r.name for r in store.listing()] == ["kept"]
    saver.close()
    assert saver._process is None


def test_the_tier_reports_remote_then_memory(store, tmp_path):
    tensors, _ = put(store, tmp_path, "doc", 300)
    finder = lookup.StoreLookup(store, ROOT, print)
    match = finder.lookup(tensors[artifact.TOKEN_IDS].tolist())
    part = lookup.plan(match.record, 0, 256).parts[0]
    tier = ChunkTier(finder.fetch, 1 << 20, 0, None, print)
    assert tier.get(part.digest, part.bytes)[1] == REMOTE
    assert tier.get(part.digest, part.bytes)[1] == "memory"


@pytest.fixture
def s3_uri(monkeypatch, request):
    from tests.support import services

    with services.moto_s3("kvcdn-fleet-test") as s3:
        for name, value in s3.env.items():
            monkeypatch.setenv(name, value)
        yield f"s3://kvcdn-fleet-test/{request.node.name[:40]}"


def test_on_s3_a_lookup_lists_only_the_index_and_fetches_only_the_planned_chunks(s3_uri, tmp_path):
    from kvcdn_core.plugin_host.registry import open_storage

    writer = ChunkStore(open_storage(s3_uri))
    tensors, _ = put(writer, tmp_path, "doc", 900, seed=3)
    put(writer, tmp_path, "other", 600, seed=4)
    backend = open_storage(s3_uri)  # another engine's view of the same store
    listed, read = [], []
    real_list, real_read, real_open = backend.list, backend.read_bytes, backend.open_read
    backend.list = lambda prefix="": listed.append(prefix) or real_list(prefix)
    backend.read_bytes = lambda key: read.append(key) or real_read(key)
    backend.open_read = lambda key: read.append(key) or real_open(key)  # chunks are read into the tier's memory
    finder = lookup.StoreLookup(ChunkStore(backend), ROOT, print)
    match = finder.lookup(tensors[artifact.TOKEN_IDS].tolist()[:520] + [5, 6])
    assert match is not None and (match.name, match.prefix_tokens) == ("doc", 520)
    plan = lookup.plan(match.record, 0, 512)
    tier = ChunkTier(finder.fetch, 1 << 20, 1 << 20, tmp_path / "tier", print)
    for part in plan.parts:
        assert tier.get(part.digest, part.bytes)[1] == REMOTE
    assert listed and all(prefix.startswith("index/") for prefix in listed)  # never the store's listing
    chunks = [key for key in read if key.startswith("chunks/")]
    assert chunks == [f"chunks/{p.digest[:2]}/{p.digest}" for p in plan.parts] and len(chunks) == 2
    assert [key for key in read if key.startswith("artifacts/")] == ["artifacts/doc.json"]


def test_a_connector_save_keeps_its_text_and_search_finds_it_in_the_store(store, tmp_path, monkeypatch):
    """A save into a chunk store keeps the prompt's text in its manifest (``kvcdn inspect`` shows it,
    a directory search checks its tokenizer against it), ``kvcdn search --store`` finds it from that
    text, and the tokenizer behind the text is loaded once per model, not once per save."""
    from kvcdn_vllm import writer

    from kvcdn_core import fingerprint, search
    from kvcdn_core.search.store import search_store
    from kvcdn_core.testing.smollm2 import smollm2_dir

    model_dir = smollm2_dir()
    text = "The keeper wrote down every ship that passed the lighthouse, and the weather it brought."
    ids = search.QueryTokenizer(model_dir)(text)["input_ids"]
    model = saves_to(store.backend.root, model_dir, fingerprint(model_dir, weights=False))
    gen = torch.Generator().manual_seed(5)
    saves = SaveQueue(model, 2, print)
    for n in (len(ids) - 4, len(ids)):  # an earlier turn, then the whole text
        layers = {i: [(torch.randn(3, n, 64, generator=gen), torch.randn(3, n, 64, generator=gen))] for i in range(2)}
        assert saves.save(f"turn{n}", ids[:n], layers)
    saves.join()
    saves.close()
    assert saves.saved == 2
    manifest = store.record(f"turn{len(ids)}").parsed_header().manifest
    assert manifest["context"] == text
    found = search_store(str(store.backend.root), text, model_ref=str(model_dir))
    assert [(h.name, h.prefix_tokens) for h in found.hits[:1]] == [(f"turn{len(ids)}", len(ids))]
    # the writer loads the tokenizer once per model (the save process writes many prompts)
    loads = []
    tokenizer = search.QueryTokenizer
    monkeypatch.setattr(search, "QueryTokenizer", lambda d: loads.append(d) or tokenizer(d))
    writer._tokenizer.cache_clear()
    assert [writer._context(model_dir, ids[:n]) for n in (5, len(ids))] == [tokenizer(model_dir).decode(ids[:5]), text]
    assert len(loads) == 1
