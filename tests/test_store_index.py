"""The chunk store's prefix index: lookups equal a brute-force longest common prefix, concurrent adds
and removes lose nothing, damaged objects are refused in one line, whole-prefix artifacts match whole.

Records here are small stand-ins with the fields the index reads (name, root, reuse, chunk_tokens,
token_count, model): the index takes any object with them, as it takes the chunk store's records.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn_core.artifact.manifest import ANY_PREFIX, WHOLE_PREFIX
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.errors import KvcdnError
from kvcdn_core.store import index, keys

FP = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}


def root_for(chunk: int, dtype: str = "float32") -> str:
    return keys.root_key(FP, keys.representation(dtype, None), chunk)


@dataclasses.dataclass
class Rec:
    name: str
    root: str
    token_count: int
    chunk_tokens: int
    reuse: str = ANY_PREFIX
    model: dict = dataclasses.field(default_factory=lambda: dict(FP, id="tiny"))
    compute_dtype: str = "float32"
    quantization: str | None = None


def brute(arts: dict[str, tuple[list[int], str]], query: list[int], start: int, limit: int) -> list[tuple]:
    """What lookup must return, by comparing the query with every artifact."""
    q = np.asarray(query)

    def lcp(ids):
        n = min(len(ids), q.size)
        diff = np.flatnonzero(np.asarray(ids[:n]) != q[:n])
        return int(diff[0]) if diff.size else n

    anyp = {name: lcp(ids) for name, (ids, reuse) in arts.items() if reuse == ANY_PREFIX}
    best = max(anyp.values(), default=0)
    hits = []
    if best > start:
        group = sorted((len(arts[n][0]), n) for n, p in anyp.items() if p == best)[:limit]
        hits += [index.Hit(n, "", best, index.usable(best, c, q.size, ANY_PREFIX), c, ANY_PREFIX) for c, n in group]
    for name, (ids, reuse) in arts.items():
        if reuse == WHOLE_PREFIX and lcp(ids) == len(ids) and len(ids) > start:
            c = len(ids)
            hits.append(index.Hit(name, "", c, index.usable(c, c, q.size, WHOLE_PREFIX), c, WHOLE_PREFIX))
    hits.sort(key=index.Hit.sort_key)
    return [(h.name, h.prefix_tokens, h.usable_tokens) for h in hits[:limit]]


def got(backend, root, query, start=0, limit=10):
    return [(h.name, h.prefix_tokens, h.usable_tokens) for h in index.lookup(backend, root, query, start, limit)]


@st.composite
def corpora(draw):
    """Artifacts that share prefixes of random lengths (branching off each other), and queries."""
    chunk = draw(st.sampled_from([2, 3, 4, 8]))
    vocab = draw(st.integers(2, 6))  # few distinct tokens: many partial in-chunk matches
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, 12))):
        base = draw(st.sampled_from(seqs)) if seqs and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, vocab), min_size=0 if keep else 1, max_size=20))
        seqs.append(base[:keep] + tail)
    reuses = [draw(st.sampled_from([ANY_PREFIX, ANY_PREFIX, WHOLE_PREFIX])) for _ in seqs]
    queries = []
    for _ in range(4):
        base = draw(st.sampled_from(seqs))
        keep = draw(st.integers(0, len(base)))
        queries.append(base[:keep] + draw(st.lists(st.integers(0, vocab), max_size=10)))
    return chunk, seqs, reuses, queries, draw(st.integers(0, 2)), draw(st.integers(1, 4))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corpora())
def test_lookup_equals_brute_force_longest_common_prefix(tmp_path_factory, corpus):
    chunk, seqs, reuses, queries, start, limit = corpus
    backend = LocalStorage(tmp_path_factory.mktemp("store"))
    root = root_for(chunk)
    arts = {}
    for i, (ids, reuse) in enumerate(zip(seqs, reuses)):
        name = f"a{i:02d}"
        index.add(backend, Rec(name, root, len(ids), chunk, reuse), ids)
        arts[name] = (ids, reuse)
    for q in queries:
        assert got(backend, root, q, start, limit) == brute(arts, q, start, limit)
    # the same after compaction into a base, and after a base plus new operations
    index.compact(backend)
    index._CACHE.clear()
    for q in queries:
        assert got(backend, root, q, start, limit) == brute(arts, q, start, limit)
    gone = sorted(arts)[0]
    index.remove(backend, Rec(gone, root, 0, chunk), None)
    del arts[gone]
    for q in queries:
        assert got(backend, root, q, start, limit) == brute(arts, q, start, limit)


@st.composite
def histories(draw):
    """A corpus written one change at a time: adds, re-adds of a name (the newer wins), removes and
    compactions, in a random order."""
    chunk, seqs, reuses, queries, start, limit = draw(corpora())
    steps: list[tuple] = []
    for i, (ids, reuse) in enumerate(zip(seqs, reuses)):
        name = f"a{draw(st.integers(0, i)):02d}" if i and draw(st.integers(0, 4)) == 0 else f"a{i:02d}"
        steps.append(("add", name, ids, reuse))
        if draw(st.integers(0, 5)) == 0:
            steps.append(("remove", f"a{draw(st.integers(0, i)):02d}"))
        if draw(st.integers(0, 7)) == 0:
            steps.append(("compact",))
    return chunk, steps, queries, start, limit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(histories())
def test_a_reader_looking_up_between_changes_equals_brute_force(tmp_path_factory, monkeypatch, history):
    # the reader keeps its index between lookups: the adds since its last full build sit in the
    # recent layer, and a lookup over both layers must equal one over the union
    chunk, steps, queries, start, limit = history
    monkeypatch.setattr(index, "NEWEST_MAX", 2)  # the newest layer merged into the recent one often
    where = tmp_path_factory.mktemp("store")
    writer = LocalStorage(where)
    readers = [LocalStorage(where)]  # and, after each compaction, one that starts on the lone base
    lagging = LocalStorage(where)  # looks up every third change only: meets a new base with adds after it
    root = root_for(chunk)
    arts: dict[str, tuple[list[int], str]] = {}
    clock = iter(range(1, 10_000))
    for n, step in enumerate(steps):
        if step[0] == "add":
            _, name, ids, reuse = step
            index.add(writer, Rec(name, root, len(ids), chunk, reuse), ids, now=lambda: next(clock))
            arts[name] = (ids, reuse)
        elif step[0] == "remove":
            assert (index.remove(writer, Rec(step[1], root, 0, chunk)) > 0) == (step[1] in arts)
            arts.pop(step[1], None)
        else:
            index.compact(writer)
            readers.append(LocalStorage(where))
        for reader in readers + ([lagging] if n % 3 == 2 else []):
            for q in queries:
                assert got(reader, root, q, start, limit) == brute(arts, q, start, limit)
    for reader in [*readers, lagging]:
        assert {a.name for a in index.load(reader).trie.arts} == set(arts)


def added(loaded) -> set[str]:
    """The names in a loaded index's recent and newest layers."""
    return {a.name for layer in (loaded.recent, loaded.newest) if layer is not None for a in layer.arts}


def test_another_writers_adds_join_the_recent_layer_and_the_rest_rebuilds(tmp_path):
    root = root_for(4)
    writer, reader = LocalStorage(tmp_path), LocalStorage(tmp_path)
    index.add(writer, Rec("a", root, 6, 4), [1, 2, 3, 4, 5, 6])
    main = index.load(reader).main
    index.add(writer, Rec("b", root, 7, 4), [1, 2, 3, 4, 5, 6, 7])
    index.add(writer, Rec("c", root, 5, 4), [9, 9, 9, 9, 9])
    loaded = index.load(reader)
    assert loaded.main is main and added(loaded) == {"b", "c"}  # no rebuild
    assert got(reader, root, [1, 2, 3, 4, 5, 6, 7, 8]) == [("b", 7, 7)]
    assert got(reader, root, [9, 9, 9, 9, 9, 1]) == [("c", 5, 5)]
    index.add(writer, Rec("a", root, 4, 4), [1, 2, 3, 4])  # a name the main layer holds: the newer wins
    loaded = index.load(reader)
    assert added(loaded) == set() and {a.name for a in loaded.main.arts} == {"a", "b", "c"}
    assert got(reader, root, [1, 2, 3, 4, 9]) == [("a", 4, 4), ("b", 4, 4)]
    index.add(writer, Rec("d", root, 5, 4), [1, 2, 3, 4, 5])
    assert added(index.load(reader)) == {"d"}
    assert index.remove(writer, Rec("b", root, 0, 4)) == 1  # a remove: b hidden in the main layer
    loaded = index.load(reader)
    assert added(loaded) == {"d"} and {loaded.main.arts[r].name for r in loaded.hidden} == {"b"}
    assert got(reader, root, [1, 2, 3, 4, 9]) == [("a", 4, 4), ("d", 4, 4)]
    assert {a.name for a in loaded.trie.arts} == {"a", "c", "d"}
    index.add(writer, Rec("b", root, 6, 4), [1, 2, 3, 4, 5, 7])  # a removed name comes back, newest layer
    loaded = index.load(reader)
    assert added(loaded) == {"b", "d"} and got(reader, root, [1, 2, 3, 4, 5, 7, 0]) == [("b", 6, 6)]
    assert index.remove(writer, Rec("d", root, 0, 4)) == 1  # a layered add removed: its layer rebuilt
    loaded = index.load(reader)
    assert added(loaded) == {"b"} and got(reader, root, [1, 2, 3, 4, 5, 0]) == [("b", 5, 5)]


def test_a_remove_hides_without_a_rebuild_and_the_next_longest_prefix_answers(tmp_path, monkeypatch):
    # the main layer keeps its trie; a lookup whose longest matches were removed walks down to the
    # next longest live one: inside the same chunk, at the chunk's start, a whole chunk shallower
    root = root_for(4)
    writer, reader = LocalStorage(tmp_path), LocalStorage(tmp_path)
    corpus = {
        "deep": [1, 2, 3, 4, 5, 6, 7, 8, 9],
        "deep2": [1, 2, 3, 4, 5, 6, 7, 8, 9, 9],
        "inside": [1, 2, 3, 4, 5, 6, 7, 0],
        "inside2": [1, 2, 3, 4, 5, 6, 0],
        "chunk": [1, 2, 3, 4, 5, 6, 7, 8],
        "boundary": [1, 2, 3, 4, 0, 0],
        "short": [1, 2, 3],
        "other": [7, 7, 7, 7, 7],
    }
    for name, ids in corpus.items():
        index.add(writer, Rec(name, root, len(ids), 4), ids)
    index.compact(writer)
    main = index.load(reader).main
    query = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9]
    live = dict(corpus)
    expected_order = ["deep2", "deep", "chunk", "inside", "inside2", "boundary", "short", "other"]
    for name in expected_order:
        assert got(reader, root, query, limit=3) == brute({n: (i, ANY_PREFIX) for n, i in live.items()}, query, 0, 3)
        assert index.load(reader).main is main and len(index.load(reader).hidden) == len(corpus) - len(live)
        if len(live) == 1:
            monkeypatch.setattr(index, "HIDDEN_MAX", len(corpus) - 1)  # one more removed than that: rebuilt
        index.remove(writer, Rec(name, root, 0, 4))
        del live[name]
    loaded = index.load(reader)
    assert loaded.main is not main and not loaded.hidden and loaded.main.arts == [] and got(reader, root, query) == []


def test_a_remove_cancelling_only_the_newer_add_of_a_name_leaves_the_older_answering(tmp_path):
    # the index is every add less the cancelled ones, the newest per name: with the newer add of a
    # name cancelled alone (a remove object naming just it), its older add is the answer again,
    # which hiding the main layer's artifact would not give: that reader builds the whole trie
    root = root_for(4)
    writer, reader = LocalStorage(tmp_path), LocalStorage(tmp_path)
    index.add(writer, Rec("x", root, 5, 4), [1, 2, 3, 4, 5], now=lambda: 1)
    newer = index.add(writer, Rec("x", root, 6, 4), [1, 2, 3, 4, 6, 6], now=lambda: 2)
    main = index.load(reader).main
    assert got(reader, root, [1, 2, 3, 4, 6, 6, 0]) == [("x", 6, 6)]
    meta = {"v": index.VERSION, "op": "del", "id": "d" * 32, "name": "x", "targets": [newer]}
    writer.write_bytes(f"{index.OPS}{'d' * 32}.del", index._pack(index.OP_MAGIC, meta, {}))
    index._changed(writer)
    loaded = index.load(reader)
    assert loaded.main is not main and not loaded.hidden
    assert got(reader, root, [1, 2, 3, 4, 5, 0]) == [("x", 5, 5)]


def test_a_new_base_with_removes_after_it_is_taken_as_stored(tmp_path):
    root = root_for(4)
    writer = LocalStorage(tmp_path)
    for i in range(5):
        index.add(writer, Rec(f"a{i}", root, 5, 4), [1, 2, 3, 4, i])
    index.compact(writer)
    index.remove(writer, Rec("a1", root, 0, 4))
    index.add(writer, Rec("b", root, 6, 4), [1, 2, 3, 4, 1, 1])
    index.remove(writer, Rec("a3", root, 0, 4))
    reader = LocalStorage(tmp_path)
    loaded = index.load(reader)
    assert loaded.lazy is not None and added(loaded) == {"b"}
    assert sorted(loaded.main.arts[r].name for r in loaded.hidden) == ["a1", "a3"]
    assert got(reader, root, [1, 2, 3, 4, 1, 1, 0]) == [("b", 6, 6)]
    assert got(reader, root, [1, 2, 3, 4, 3]) == [("a0", 4, 4), ("a2", 4, 4), ("a4", 4, 4), ("b", 4, 4)]
    assert {a.name for a in loaded.trie.arts} == {"a0", "a2", "a4", "b"}


def test_the_match_is_exact_inside_a_chunk_and_other_roots_do_not_match(tmp_path):
    backend = LocalStorage(tmp_path)
    root, other = root_for(256), root_for(256, "bfloat16")
    doc = list(range(1000))
    index.add(backend, Rec("doc", root, 1000, 256), doc)
    index.add(backend, Rec("short", root, 300, 256), doc[:300])
    index.add(backend, Rec("bf16", other, 1000, 256), doc)
    query = doc[:700] + [5, 6, 7]
    hits = index.lookup(backend, root, query)
    assert [(h.name, h.prefix_tokens, h.usable_tokens) for h in hits] == [("doc", 700, 700)]
    assert [h.name for h in index.lookup(backend, other, query)] == ["bf16"]
    # ends inside the second chunk: the shorter artifact is the best (it loads faster)
    hits = index.lookup(backend, root, doc[:290] + [9999])
    assert [(h.name, h.prefix_tokens) for h in hits] == [("short", 290), ("doc", 290)]
    assert hits[0].compute_dtype == "float32" and hits[0].quantization is None


def test_whole_prefix_artifacts_serve_only_queries_containing_them_whole(tmp_path):
    backend = LocalStorage(tmp_path)
    root = root_for(4)
    state = list(range(10))
    index.add(backend, Rec("state", root, 10, 4, WHOLE_PREFIX), state)
    index.add(backend, Rec("chunked", root, 6, 4), state[:6])
    assert got(backend, root, state + [42]) == [("state", 10, 10), ("chunked", 6, 6)]
    assert got(backend, root, state) == [("chunked", 6, 6), ("state", 10, 0)]  # no token left to prefill
    assert got(backend, root, state[:9] + [42]) == [("chunked", 6, 6)]  # stops short: not usable at all


def test_a_base_without_artifacts_fixes_no_chunk_size(tmp_path):
    # A compaction can list no add at all: the store is empty, or its listing (not atomic) missed the
    # base another writer had just folded everything into. Its base must not impose the default chunk
    # size on the adds that follow (CI once refused a 4-token add: "the index 256").
    backend = LocalStorage(tmp_path)
    root = root_for(4)
    index.compact(backend)
    index.add(LocalStorage(tmp_path), Rec("gone", root, 5, 4), [1, 2, 3, 4, 5])
    index.remove(LocalStorage(tmp_path), Rec("gone", root, 0, 4))
    index.compact(LocalStorage(tmp_path))  # cancellations only, no live artifact
    index.add(LocalStorage(tmp_path), Rec("kept", root, 6, 4), [1, 2, 3, 4, 5, 6])
    for view in (LocalStorage(tmp_path), backend):  # read afresh, and on top of a cached base
        assert [(h.name, h.prefix_tokens) for h in index.lookup(view, root, [1, 2, 3, 4, 5, 6, 7])] == [("kept", 6)]


class CompactedMidListing(LocalStorage):
    """A store whose listing of the index is interrupted, once, by another writer's compaction: a
    listing is not atomic (a directory walk, S3's pages). One listing of ``index/`` walks the bases
    first, as a directory walk may; listings of its two folders get the compaction between them."""

    interrupted = False

    def _compaction_by_another_writer(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            index.compact(LocalStorage(self.root))

    def list(self, prefix=""):
        if prefix == index.PREFIX:
            bases = super().list(index.BASES)
            self._compaction_by_another_writer()
            return bases + super().list(index.OPS)
        found = super().list(prefix)
        if prefix in (index.OPS, index.BASES):
            self._compaction_by_another_writer()
        return found


def test_a_compaction_during_the_listing_hides_no_artifact(tmp_path):
    # the compaction folds x's add into a new base and deletes the add: read bases first, then the
    # operations, and x would be in neither, and a remove would cancel nothing
    root = root_for(4)
    index.add(LocalStorage(tmp_path), Rec("x", root, 6, 4), [1, 2, 3, 4, 5, 6])
    view = CompactedMidListing(tmp_path)
    assert index.remove(view, Rec("x", root, 0, 4)) == 1
    assert view.interrupted
    assert index.lookup(LocalStorage(tmp_path), root, [1, 2, 3, 4, 5, 6, 7]) == []


def test_concurrent_adds_and_removes_lose_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "COMPACT_AFTER", 8)  # compactions run among the adds and removes
    root = root_for(4)
    rng = np.random.default_rng(0)
    docs = {
        f"t{t}-a{i}": rng.integers(0, 50, size=int(rng.integers(1, 30))).tolist() for t in range(6) for i in range(12)
    }
    removed = {name for name in docs if name.endswith(("a3", "a7", "a11"))}
    errors = []

    def worker(t):
        try:
            mine = LocalStorage(tmp_path)  # each writer its own process-like view: no shared cache
            for name, ids in docs.items():
                if name.startswith(f"t{t}-"):
                    index.add(mine, Rec(name, root, len(ids), 4), ids)
            for name in sorted(removed):
                if name.startswith(f"t{t}-"):
                    assert index.remove(mine, Rec(name, root, 0, 4)) == 1
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    fresh = LocalStorage(tmp_path)
    assert {a.name for a in index.load(fresh).trie.arts} == set(docs) - removed
    for name, ids in docs.items():
        names = [h.name for h in index.lookup(fresh, root, ids + [999], limit=100)]
        assert (name in names) == (name not in removed), name


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b"garbage",
        lambda b: b[:40],
        lambda b: b.replace(b'"v":1', b'"v":9', 1),
        lambda b: index.BASE_MAGIC + b[8:],
    ],
)
def test_a_damaged_or_foreign_object_is_refused_in_one_line_and_rebuild_recovers(tmp_path, damage):
    backend = LocalStorage(tmp_path)
    root = root_for(4)
    rec = Rec("a", root, 9, 4)
    ids = list(range(9))
    key = f"index/ops/{index.add(backend, rec, ids)}.add"
    index._CACHE.clear()
    backend.write_bytes(key, damage(backend.read_bytes(key)))
    with pytest.raises(KvcdnError) as err:
        index.lookup(backend, root, ids)
    assert "\n" not in str(err.value) and key in str(err.value) and "rebuild" in str(err.value)
    assert index.rebuild(backend, [(rec, ids)]) == 1
    assert got(backend, root, ids + [1]) == [("a", 9, 9)]
    assert [o.key for o in backend.list("index/")][0].startswith("index/base/")


def test_a_readd_replaces_and_the_index_is_compact(tmp_path):
    backend = LocalStorage(tmp_path)
    root = root_for(256)
    shared = list(range(2048))
    for i in range(20):
        index.add(backend, Rec(f"rag{i}", root, 2560, 256), shared + list(range(10_000 + 512 * i, 10_512 + 512 * i)))
    index.add(backend, Rec("rag0", root, 2048, 256), shared)  # the same name again: the newer wins
    hits = index.lookup(backend, root, shared + [7], limit=30)
    assert [h.name for h in hits][:1] == ["rag0"] and len(hits) == 20 and hits[0].token_count == 2048
    index.compact(backend)
    stored = index.stats(backend)["stored_bytes"]
    # the shared 2,048 tokens are kept once: 20 artifacts cost ~ 2,048 + 19 x 512 tokens of 4 bytes
    assert stored < 4 * (2048 + 20 * 512) + 20 * 400


def test_a_lookup_reads_a_logarithmic_number_of_chunks_whatever_the_store_size(tmp_path, monkeypatch):
    """Unrelated documents all hang off the root: the in-chunk refinement binary-searches them."""
    rng = np.random.default_rng(1)
    root = root_for(8)
    counts = {}
    for n in (16, 4096):
        backend = LocalStorage(tmp_path / str(n))
        docs = rng.integers(0, 1000, size=(n, 24)).tolist()
        index.rebuild(backend, [(Rec(f"d{i}", root, 24, 8), d) for i, d in enumerate(docs)])
        index.load(backend)
        reads = []
        real = index._Trie.edge_tokens
        monkeypatch.setattr(index._Trie, "edge_tokens", lambda self, node: reads.append(node) or real(self, node))
        query = docs[n // 2][:13] + [5000]  # shares one chunk and 5 tokens of the next
        assert got(backend, root, query) == [(f"d{n // 2}", 13, 13)]
        monkeypatch.setattr(index._Trie, "edge_tokens", real)
        counts[n] = len(reads)
    assert counts[4096] <= 3 * 12 + 4  # log2(4096) = 12 per binary search
    assert counts[4096] - counts[16] <= 3 * (12 - 4) + 2


class Counted(LocalStorage):
    """A view of a store that counts its listings, and runs ``between`` once where the test puts it:
    after the change mark is read and before the listing (``at="listing"``), or after the listing
    and before the objects are read (``at="reading"``)."""

    def __init__(self, root, between=None, at=""):
        super().__init__(root)
        self.listings, self.between, self.at = 0, between, at

    def _once(self, here: str) -> None:
        if self.between is not None and self.at == here:
            run, self.between = self.between, None
            run()

    def read_bytes(self, key):
        data = super().read_bytes(key)
        if key == index.MARK:
            self._once("listing")
        return data

    def list(self, prefix=""):
        self.listings += 1
        found = super().list(prefix)
        if prefix == index.BASES:
            self._once("reading")
        return found


def test_a_lookup_lists_nothing_while_the_change_mark_stays_and_sees_every_finished_change(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "RELIST_S", float("inf"))  # a slow machine's seconds list nothing either
    root = root_for(4)
    index.add(LocalStorage(tmp_path), Rec("a", root, 6, 4), [1, 2, 3, 4, 5, 6])
    reader = Counted(tmp_path)
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7])] == ["a"]
    listed = reader.listings
    for _ in range(3):
        assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7])] == ["a"]
    assert reader.listings == listed  # the mark is as it was: one small read per lookup, no listing

    other = LocalStorage(tmp_path)  # another process's writes, each seen by the next lookup
    index.add(other, Rec("b", root, 7, 4), [1, 2, 3, 4, 5, 6, 7])
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7, 8])] == ["b"]
    assert index.remove(other, Rec("b", root, 0, 4)) == 1
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7, 8])] == ["a"]
    index.compact(other)
    index.add(other, Rec("c", root, 8, 4), [1, 2, 3, 4, 9, 9, 9, 9])
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 9, 9, 9, 9])] == ["c"]
    assert reader.listings > listed


@pytest.mark.parametrize("at", ["listing", "reading"])
def test_an_add_finishing_during_a_load_is_seen_by_the_next_lookup(tmp_path, at):
    # between the mark's read and the listing, the listing may show the add or not; after the
    # listing, it does not: either way the mark the load kept is older than the add's, so the next
    # lookup lists again and finds it
    root = root_for(4)
    index.add(LocalStorage(tmp_path), Rec("a", root, 6, 4), [1, 2, 3, 4, 5, 6])

    def another_writer() -> None:
        index.add(LocalStorage(tmp_path), Rec("b", root, 7, 4), [1, 2, 3, 4, 5, 6, 7])

    reader = Counted(tmp_path, another_writer, at)
    first = [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7, 8])]
    assert reader.between is None and first == (["b"] if at == "listing" else ["a"])
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7, 8])] == ["b"]


def test_a_store_without_the_mark_is_listed_at_every_lookup(tmp_path, monkeypatch):
    # a store written by a kvcdn before the change mark has none: its readers list, as they did
    root = root_for(4)
    older = LocalStorage(tmp_path)
    monkeypatch.setattr(index, "_changed", lambda backend: None)
    index.add(older, Rec("a", root, 6, 4), [1, 2, 3, 4, 5, 6])
    reader = Counted(tmp_path)
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7])] == ["a"]
    index.add(older, Rec("b", root, 7, 4), [1, 2, 3, 4, 5, 6, 7])
    listed = reader.listings
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7, 8])] == ["b"]
    assert reader.listings == listed + 2


def test_concurrent_lookups_see_every_finished_add_and_remove(tmp_path, monkeypatch):
    """Writers add and remove (compacting among them) while a reader loads the index over and over:
    every load sees each add finished before it began (unless its remove had begun by the load's
    end), and no artifact whose remove finished before it began."""
    monkeypatch.setattr(index, "COMPACT_AFTER", 8)
    root = root_for(4)
    added, removing, removed = set(), set(), set()
    errors: list[BaseException] = []
    writing = threading.Event()
    writing.set()

    def writer(t: int) -> None:
        try:
            mine = LocalStorage(tmp_path)
            for i in range(30):
                name = f"t{t}-a{i}"
                index.add(mine, Rec(name, root, 5, 4), [t, i, 1, 2, 3])
                added.add(name)
                if i % 3 == 0:
                    removing.add(name)
                    assert index.remove(mine, Rec(name, root, 0, 4)) == 1
                    removed.add(name)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    loads = 0

    def found(view, name: str) -> bool:
        """Whether a lookup (both layers, no refresh) holds ``name``'s own 5 tokens."""
        t, i = (int(part[1:]) for part in name.split("-"))
        hits = index.lookup(view, root, [t, i, 1, 2, 3, 99], limit=100, refresh=False)
        return any(h.name == name and h.prefix_tokens == 5 for h in hits)

    def reader() -> None:
        nonlocal loads
        try:
            view = Counted(tmp_path)
            while writing.is_set():
                done, gone = set(added), set(removed)
                index.load(view)
                names = {name for name in done | gone if found(view, name)}  # in the snapshot just loaded
                assert done - set(removing) <= names, sorted(done - set(removing) - names)
                assert not gone & names, sorted(gone & names)
                loads += 1
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    looking = threading.Thread(target=reader)
    looking.start()
    for th in writers:
        th.start()
    for th in writers:
        th.join()
    writing.clear()
    looking.join()
    assert not errors, errors
    assert loads > 0
    final = {a.name for a in index.load(Counted(tmp_path)).trie.arts}
    assert final == added - removed and len(final) == 60


def test_a_name_added_twice_then_removed_stays_removed_for_the_process_that_compacted(tmp_path):
    # the compaction's base cancels the older add of a name added twice; the process that wrote
    # it must not keep that add live: another process's remove cancels only the newer one
    root = root_for(4)
    mine, other = LocalStorage(tmp_path), LocalStorage(tmp_path)
    index.add(mine, Rec("x", root, 6, 4), [1, 2, 3, 4, 5, 6], now=lambda: 1)
    index.add(mine, Rec("x", root, 5, 4), [1, 2, 3, 4, 5], now=lambda: 2)
    index.compact(mine)
    assert index.remove(other, Rec("x", root, 0, 4)) == 1
    assert got(mine, root, [1, 2, 3, 4, 5, 6, 7]) == []
    index.compact(mine)
    assert got(LocalStorage(tmp_path), root, [1, 2, 3, 4, 5, 6, 7]) == []


def test_a_change_the_mark_missed_is_seen_within_the_relist_time(tmp_path, monkeypatch):
    # a writer whose mark failed after its object, or a kvcdn from before the mark: the reader
    # lists again once RELIST_S has passed on its (injected) clock, whatever the mark says
    root = root_for(4)
    now = [1000.0]
    monkeypatch.setattr(index, "_clock", lambda: now[0])
    index.add(LocalStorage(tmp_path), Rec("a", root, 6, 4), [1, 2, 3, 4, 5, 6])
    reader = Counted(tmp_path)
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7])] == ["a"]

    class MarkFails(LocalStorage):
        def write_bytes(self, key, data):
            if key == index.MARK:
                raise ConnectionError("store unreachable")
            super().write_bytes(key, data)

    with pytest.raises(ConnectionError):
        index.add(MarkFails(tmp_path), Rec("b", root, 7, 4), [1, 2, 3, 4, 5, 6, 7])
    now[0] += index.RELIST_S - 0.5
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7, 8])] == ["a"]  # mark unchanged
    now[0] += 1.0
    assert [h.name for h in index.lookup(reader, root, [1, 2, 3, 4, 5, 6, 7, 8])] == ["b"]


def test_a_new_base_is_taken_as_stored_with_the_adds_after_it_in_the_recent_layer(tmp_path):
    root = root_for(4)
    writer = LocalStorage(tmp_path)
    index.add(writer, Rec("a", root, 6, 4), [1, 2, 3, 4, 5, 6])
    folded = index.add(writer, Rec("b", root, 7, 4), [1, 2, 3, 4, 5, 6, 7])
    warm = LocalStorage(tmp_path)
    index.load(warm)
    op = writer.read_bytes(f"{index.OPS}{folded}.add")
    index.compact(writer)
    index.add(writer, Rec("c", root, 5, 4), [9, 9, 9, 9, 9])
    writer.write_bytes(f"{index.OPS}{folded}.add", op)  # a folded add its compaction has not deleted yet
    for reader in (warm, LocalStorage(tmp_path)):  # one that read the adds before, one that starts now
        loaded = index.load(reader)
        assert loaded.lazy is not None and {a.name for a in loaded.main.arts} == {"a", "b"}  # no rebuild
        assert added(loaded) == {"c"}  # the folded add is the base's, not recent
        assert got(reader, root, [1, 2, 3, 4, 5, 6, 7, 8]) == [("b", 7, 7)]
        assert got(reader, root, [9, 9, 9, 9, 9, 1]) == [("c", 5, 5)]
        assert {a.name for a in loaded.trie.arts} == {"a", "b", "c"}


def test_the_newest_layer_stays_small_and_merges_into_the_recent_one(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "NEWEST_MAX", 3)
    root = root_for(4)
    writer, reader = LocalStorage(tmp_path), LocalStorage(tmp_path)
    index.add(writer, Rec("base", root, 4, 4), [7, 7, 7, 7])
    index.load(reader)
    for i in range(5):
        index.add(writer, Rec(f"n{i}", root, 5, 4), [1, 2, 3, 4, i])
    loaded = index.load(reader)  # the five in one read: past the newest layer's size, all recent
    assert {a.name for a in loaded.recent.arts} == {f"n{i}" for i in range(5)} and loaded.newest is None
    index.add(writer, Rec("n5", root, 5, 4), [1, 2, 3, 4, 5])
    loaded = index.load(reader)
    recent = loaded.recent
    assert {a.name for a in loaded.newest.arts} == {"n5"}  # the recent layer is not rebuilt
    index.add(writer, Rec("n0", root, 6, 4), [1, 2, 3, 4, 0, 0], now=lambda: time.time_ns() + 10**9)
    loaded = index.load(reader)  # a name the recent layer holds: merged there, the newer wins
    assert loaded.recent is not recent and loaded.newest is None
    assert got(reader, root, [1, 2, 3, 4, 0, 0, 1]) == [("n0", 6, 6)]
    assert got(reader, root, [1, 2, 3, 4, 0, 9]) == [("n0", 5, 5)]  # once: the older add is gone
    assert got(reader, root, [1, 2, 3, 4, 5, 1]) == [("n5", 5, 5)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.randoms(use_true_random=False))
def test_processes_sharing_one_index_each_equal_brute_force(tmp_path_factory, monkeypatch, rng):
    """Several processes (each its own view and cache) add, re-add, remove and compact in turn, two
    roots, small layers, few hidden removes and early compactions; after every change, every process's lookups equal a
    brute-force longest common prefix over what is indexed."""
    monkeypatch.setattr(index, "COMPACT_AFTER", 5)
    monkeypatch.setattr(index, "RECENT_MAX", 6)
    monkeypatch.setattr(index, "NEWEST_MAX", 2)
    monkeypatch.setattr(index, "HIDDEN_MAX", 2)  # a third remove since the main layer's build rebuilds
    where = tmp_path_factory.mktemp("store")
    chunk = rng.choice([2, 3, 4])
    roots = [root_for(chunk), root_for(chunk, "bfloat16")]
    views = [LocalStorage(where) for _ in range(3)]
    truth: dict[str, dict[str, tuple[list[int], str]]] = {r: {} for r in roots}
    root_of: dict[str, str] = {}
    clock = iter(range(1, 10_000))
    seqs: list[list[int]] = []

    def sequence() -> list[int]:
        base = rng.choice(seqs) if seqs and rng.random() < 0.6 else []
        keep = rng.randint(0, len(base))
        return base[:keep] + [rng.randint(0, 3) for _ in range(rng.randint(0 if keep else 1, 12))]

    for step in range(40):
        view, draw = rng.choice(views), rng.random()
        if draw < 0.55:
            name = rng.choice(sorted(root_of)) if root_of and rng.random() < 0.3 else f"n{step}"
            root, ids, reuse = rng.choice(roots), sequence(), rng.choice([ANY_PREFIX, ANY_PREFIX, WHOLE_PREFIX])
            seqs.append(ids)
            index.add(view, Rec(name, root, len(ids), chunk, reuse), ids, now=lambda: next(clock))
            if name in root_of:
                truth[root_of[name]].pop(name)
            truth[root][name], root_of[name] = (ids, reuse), root
        elif draw < 0.7 and root_of:
            name = rng.choice(sorted(root_of))
            assert index.remove(view, Rec(name, root_of[name], 0, chunk)) > 0
            truth[root_of.pop(name)].pop(name)
        elif draw < 0.8:
            index.compact(view)
        elif draw < 0.85:
            views.append(LocalStorage(where))
        for reader in views:
            for root in roots:
                query = sequence()[: rng.randint(0, 14)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 4))]
                start, limit = rng.randint(0, 2), rng.randint(1, 4)
                assert got(reader, root, query, start, limit) == brute(truth[root], query, start, limit)


def test_an_artifact_of_no_tokens_in_a_base_is_no_damage(tmp_path):
    # it ends on no edge (node -1); a base holding one is taken as stored by every reader
    root = root_for(4)
    writer, warm = LocalStorage(tmp_path), LocalStorage(tmp_path)
    index.add(writer, Rec("a", root, 5, 4), [1, 2, 3, 4, 5])
    index.add(writer, Rec("empty", root, 0, 4), [])
    assert got(warm, root, [1, 2, 3, 9]) == [("a", 3, 3)]
    index.compact(writer)
    for reader in (warm, LocalStorage(tmp_path)):
        assert got(reader, root, [1, 2, 3, 9]) == [("a", 3, 3)]
        assert {a.name for a in index.load(reader).trie.arts} == {"a", "empty"}
