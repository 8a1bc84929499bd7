"""The connector's chunk-store side without vLLM: a prompt looked up in a real store's prefix index,
the load plan and the tensors its chunks rebuild, a store that fails being a miss, and the save
queue (only new chunks put, back pressure, and a run of failures as one warning line)."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from kvcdn_vllm import lookup
from kvcdn_vllm.catalog import ModelShape, check_fits
from kvcdn_vllm.saver import SaveQueue
from kvcdn_vllm.tier import REMOTE, ChunkTier

from kvcdn_core import artifact
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.store.chunkstore import ChunkStore
from tests.support.storefiles import write_kinds

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


def test_saves_put_only_new_chunks_in_the_background(store, tmp_path):
    first, _ = put(store, tmp_path, "turn1", 512, seed=1)
    done = []
    warnings: list[str] = []
    saver = SaveQueue(store, 2, warnings.append, lambda name, report: done.append(report))

    def write(directory):
        write_kinds(directory / "turn2.kv", ["full_attention"] * 3, 700, seed=2, prefix_of=first)
        return directory / "turn2.kv"

    assert saver.submit("turn2", write)
    saver.join()
    (report,) = done
    assert (report.chunks, report.chunks_new) == (3, 1)  # the two chunks of turn 1 were there
    assert lookup.StoreLookup(store, ROOT, print).lookup(first[artifact.TOKEN_IDS].tolist() + [1]).prefix_tokens == 512
    saver.close()
    assert warnings == []


def test_a_save_is_hashed_once_by_its_writer_and_once_by_the_put_and_comes_back_bitwise(store, tmp_path, monkeypatch):
    """The queue's thread wrote the file and hashed its tensors a moment ago: core's put cuts it
    without checking it against its manifest again, and the store gives back the same bytes."""
    from kvcdn_core.store import pack

    first, _ = put(store, tmp_path, "turn1", 300, seed=1)
    checks = []
    check = pack.Cutter.check_digests
    monkeypatch.setattr(pack.Cutter, "check_digests", lambda self: checks.append(1) or check(self))
    written = {}

    def write(directory):
        path = directory / "turn2.kv"
        write_kinds(path, ["full_attention"] * 3, 450, seed=2, prefix_of=first)
        written["bytes"] = path.read_bytes()
        return path

    saver = SaveQueue(store, 1, print)
    assert saver.submit("turn2", write)
    saver.join()
    saver.close()
    assert saver.saved == 1 and checks == []
    store.get("turn2", tmp_path / "back.kv")
    assert (tmp_path / "back.kv").read_bytes() == written["bytes"]
    assert store.record("turn2").chunks[1].pieces  # turn 1's partial chunk, then the new rest
    store.put(tmp_path / "turn1.kv", "turn1-again", force=True)  # a file from elsewhere: checked
    assert checks == [1]


def test_a_full_queue_skips_and_a_failed_save_is_one_line(store, tmp_path):
    warnings: list[str] = []
    saver = SaveQueue(store, 1, warnings.append)
    gate, started = threading.Event(), threading.Event()

    def blocked(directory):
        started.set()
        gate.wait()
        raise OSError("No space left on device")

    assert saver.submit("a", blocked)
    started.wait()  # the thread took "a" and is busy with it
    assert saver.submit("b", blocked)  # waits in the queue
    assert not saver.submit("c", blocked)  # the queue is full: skipped, the caller never waits
    gate.set()
    saver.join()
    assert warnings == [
        "not saving c: 1 saves are already waiting for the store",
        "not saving a: No space left on device (saves that fail after this one are counted, not logged, "
        "until one works again)",
    ]  # b failed too: counted, not logged
    assert (saver.saved, saver.skipped, saver.failed) == (0, 1, 2)
    saver.close()


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
    real_list, real_read = backend.list, backend.read_bytes
    backend.list = lambda prefix="": listed.append(prefix) or real_list(prefix)
    backend.read_bytes = lambda key: read.append(key) or real_read(key)
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
    from types import SimpleNamespace

    from kvcdn_vllm import writer

    from kvcdn_core import fingerprint, search
    from kvcdn_core.search.store import search_store
    from kvcdn_core.testing.smollm2 import smollm2_dir

    model_dir = smollm2_dir()
    loads = []
    tokenizer = search.QueryTokenizer
    monkeypatch.setattr(search, "QueryTokenizer", lambda d: loads.append(d) or tokenizer(d))
    writer._tokenizer.cache_clear()
    text = "The keeper wrote down every ship that passed the lighthouse, and the weather it brought."
    ids = tokenizer(model_dir)(text)["input_ids"]
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(model_dir), revision=None))
    gen = torch.Generator().manual_seed(5)
    saver = SaveQueue(store, 2, print)
    for n in (len(ids) - 4, len(ids)):  # an earlier turn, then the whole text
        layers = {i: (torch.randn(3, n, 64, generator=gen), torch.randn(3, n, 64, generator=gen)) for i in range(2)}
        write = functools.partial(
            writer.write_prompt_artifact,
            vllm_config=config,
            model_dir=model_dir,
            fingerprint=fingerprint(model_dir, weights=False),
            prompt_ids=ids[:n],
            layers=layers,
        )
        assert saver.submit(f"turn{n}", write)
    saver.join()
    saver.close()
    assert saver.saved == 2 and len(loads) == 1
    manifest = store.record(f"turn{len(ids)}").parsed_header().manifest
    assert manifest["context"] == text
    found = search_store(str(store.backend.root), text, model_ref=str(model_dir))
    assert [(h.name, h.prefix_tokens) for h in found.hits[:1]] == [(f"turn{len(ids)}", len(ids))]
