"""The chunk store's prefix index: lookups equal a brute-force longest common prefix, concurrent adds
and removes lose nothing, damaged objects are refused in one line, whole-prefix artifacts match whole.

Records here are small stand-ins with the fields the index reads (name, root, reuse, chunk_tokens,
token_count, model): the index takes any object with them, as it takes the chunk store's records.
"""

from __future__ import annotations

import dataclasses
import threading

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
