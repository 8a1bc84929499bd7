"""``search --dir`` through the prefix index: exactly the linear ranking, kept up to date, safe to share.

The equality tests build entries in memory (token ids from a tiny vocabulary, so prefixes are shared
often and across chunk boundaries); the update, concurrency and damage tests write real artifacts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcdn_core import search
from kvcdn_core.artifact.manifest import ANY_PREFIX, WHOLE_PREFIX
from kvcdn_core.model.files import fingerprint
from kvcdn_core.search import prefix
from kvcdn_core.search.index import Entry, scan
from tests.test_search import write_fake

FP_A = {"architecture": "A", "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}
FP_B = {**FP_A, "config_sha256": "d" * 64}


def rows(ranking):
    return [(str(m.path), m.prefix_tokens, m.usable_tokens) for m in ranking.matches], (
        ranking.same_model,
        ranking.foreign,
    )


def corpus(seed: int, n: int) -> tuple[list[Entry], list[np.ndarray]]:
    """Entries sharing prefixes of every length (a few documents, cut and continued), and queries."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 3, size=700) for _ in range(3)]
    entries, queries = [], []
    for i in range(n):
        doc = docs[int(rng.integers(len(docs)))]
        keep = int(rng.integers(0, 700))
        tail = rng.integers(0, 3, size=int(rng.integers(0, 300)))
        ids = np.concatenate([doc[:keep], tail]).astype(np.int32)
        fp = FP_A if rng.random() < 0.8 else FP_B
        model_id = "m" if rng.random() < 0.7 else "renamed"
        reuse = ANY_PREFIX if rng.random() < 0.8 else WHOLE_PREFIX
        quant = None if rng.random() < 0.8 else "int8"
        entries.append(
            Entry(
                Path(f"/c/d{i % 3}/a{i:03d}.kv"),
                100 + i,
                i,
                i,
                {"id": model_id, **fp},
                ids.size,
                reuse,
                "float32",
                quant,
                ids,
            )
        )
    for _ in range(8):
        doc = docs[int(rng.integers(len(docs)))]
        cut = int(rng.integers(0, 700))
        queries.append(np.concatenate([doc[:cut], rng.integers(0, 3, size=int(rng.integers(0, 40)))]))
    return entries, queries


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 60), start=st.sampled_from([0, 1, 2, 5, 255, 256, 300]))
def test_index_ranking_equals_the_linear_ranking(seed, n, start):
    entries, queries = corpus(seed, n)
    with tempfile.TemporaryDirectory() as tmp:
        for e in entries:
            e.path = Path(tmp) / e.path.relative_to("/c")
        index = prefix.open_index(tmp, entries)
        again = prefix.open_index(tmp, entries)  # the kept file, read back
        assert again.rebuilt == 0
        for q in queries:
            for fp in (FP_A, FP_B):
                linear = rows(search.rank(entries, fp, q, start))
                assert rows(index.rank(fp, q, start)) == linear
                assert rows(again.rank(fp, q, start)) == linear


DOC = [(7 * i) % 50 + 10 for i in range(700)]
OTHER = [(11 * i + 3) % 50 + 10 for i in range(700)]
QUERIES = [DOC[:20], DOC[:299] + [3], DOC[:600], OTHER[:300], [99, 98], DOC[:1]]


def check(directory, model_dir):
    """Scan, open the index, and compare every query with the linear ranking; return the index."""
    entries = scan(directory)
    index = prefix.open_index(directory, entries)
    fp = fingerprint(model_dir)
    for q in QUERIES:
        for start in (0, 1):
            assert rows(index.rank(fp, q, start)) == rows(search.rank(entries, fp, q, start))
    return index


def names(index, model_dir, q):
    return sorted(os.path.basename(m.path) for m in index.rank(fingerprint(model_dir), q, 0).matches)


def test_updates_add_remove_replace_rename_rewrite(tmp_path, qwen3_dir):
    d = tmp_path / "kv"
    write_fake(d / "a.kv", qwen3_dir, DOC[:300])
    write_fake(d / "b.kv", qwen3_dir, DOC[:100] + OTHER[100:200])
    write_fake(d / "sub" / "c.kv", qwen3_dir, DOC[:500])
    write_fake(d / "w.kv", qwen3_dir, DOC[:50], kinds=("sliding_window",))
    assert check(d, qwen3_dir).rebuilt == 3  # whole-prefix artifacts are compared, not indexed
    assert check(d, qwen3_dir).rebuilt == 0
    assert names(check(d, qwen3_dir), qwen3_dir, DOC[:600]) == ["a.kv", "b.kv", "c.kv", "w.kv"]

    write_fake(d / "e.kv", qwen3_dir, DOC[:400])  # added: only it is hashed
    assert check(d, qwen3_dir).rebuilt == 1
    (d / "b.kv").unlink()  # removed
    index = check(d, qwen3_dir)
    assert index.rebuilt == 0 and "b.kv" not in names(index, qwen3_dir, DOC[:600])
    write_fake(d / "a.kv", qwen3_dir, OTHER[:300])  # replaced (a new file renamed over it)
    index = check(d, qwen3_dir)
    assert index.rebuilt == 1 and "a.kv" in names(index, qwen3_dir, OTHER[:300])
    assert "a.kv" not in names(index, qwen3_dir, DOC[:600])
    os.rename(d / "sub" / "c.kv", d / "sub" / "f.kv")  # renamed
    index = check(d, qwen3_dir)
    assert index.rebuilt == 1 and "f.kv" in names(index, qwen3_dir, DOC[:600])

    # rewritten in place: same inode, new bytes (a search stats every file, so it is seen)
    inode = os.stat(d / "e.kv").st_ino
    write_fake(tmp_path / "new.kv", qwen3_dir, OTHER[:250])
    with open(d / "e.kv", "r+b") as fh:
        fh.write((tmp_path / "new.kv").read_bytes())
        fh.truncate()
    assert os.stat(d / "e.kv").st_ino == inode
    index = check(d, qwen3_dir)
    assert index.rebuilt == 1 and "e.kv" in names(index, qwen3_dir, OTHER[:300])
    assert "e.kv" not in names(index, qwen3_dir, DOC[:600])


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:],
        lambda b: b[:-1] + bytes([b[-1] ^ 0x80]),
        lambda b: b"",
        lambda b: b"garbage" * 10,
        lambda b: b"KVCDNPX1" + bytes(32) + b[40:],
    ],
    ids=["truncated", "flipped", "flipped-last", "empty", "garbage", "wrong-digest"],
)
def test_a_damaged_index_file_is_rebuilt_not_trusted(tmp_path, qwen3_dir, damage):
    d = tmp_path / "kv"
    write_fake(d / "a.kv", qwen3_dir, DOC[:300])
    write_fake(d / "b.kv", qwen3_dir, DOC[:100] + OTHER[100:])
    check(d, qwen3_dir)
    kept = d / prefix.PREFIX_NAME
    kept.write_bytes(damage(kept.read_bytes()))
    assert check(d, qwen3_dir).rebuilt == 2
    assert check(d, qwen3_dir).rebuilt == 0  # rewritten whole


def test_concurrent_searches_with_different_views_stay_exact(tmp_path, qwen3_dir):
    """Two searches updating one kept file at once, each seeing other artifacts: both exact."""
    d = tmp_path / "kv"
    for i in range(12):
        write_fake(d / f"a{i:02d}.kv", qwen3_dir, DOC[: 30 * (i + 1)] + OTHER[: 5 * i])
    entries = scan(d)
    views = [entries[::2], entries[1::2], entries]
    fp = fingerprint(qwen3_dir)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(views))

    def run(view):
        try:
            barrier.wait()
            for _ in range(15):
                index = prefix.open_index(d, view)
                for q in QUERIES:
                    assert rows(index.rank(fp, q, 0)) == rows(search.rank(view, fp, q, 0))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(v,)) for v in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert prefix._read(d / prefix.PREFIX_NAME)[0] is not None  # whoever wrote last, the file is whole


def test_search_while_artifacts_are_written(tmp_path, qwen3_dir):
    """Artifacts added and replaced (atomic renames) during searches: every search is exact."""
    d = tmp_path / "kv"
    write_fake(d / "seed.kv", qwen3_dir, DOC[:200])
    done = threading.Event()
    errors: list[BaseException] = []

    def writer():
        try:
            for i in range(10):
                write_fake(d / f"w{i % 4}.kv", qwen3_dir, DOC[: 40 * (i + 1)] + OTHER[:i])
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    searches = 0
    while not done.is_set() or searches < 3:
        check(d, qwen3_dir)
        searches += 1
    t.join()
    assert not errors, errors
    final = check(d, qwen3_dir)
    assert len(final.by_name) == 5


def test_search_command_goes_through_the_index(tmp_path, qwen3_dir):
    d = tmp_path / "kv"
    write_fake(d / "a.kv", qwen3_dir, DOC[:300])
    found = search.search(d, "some query", str(qwen3_dir))
    assert found.index is not None and (d / prefix.PREFIX_NAME).is_file()
    assert rows(found.ranking) == rows(
        search.rank(found.entries, found.fingerprint, found.query_ids, found.start_tokens)
    )


def test_read_only_directory_keeps_its_prefix_index_in_the_user_cache(tmp_path, qwen3_dir, monkeypatch):
    from kvcdn_core.search import index as search_index

    d = tmp_path / "shared"
    write_fake(d / "a.kv", qwen3_dir, DOC[:300])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(search_index.os, "access", lambda path, mode: False)
    assert check(d, qwen3_dir).rebuilt == 1
    kept = list((tmp_path / "cache" / "kvcdn" / "search-prefix").iterdir())
    assert len(kept) == 1 and not (d / prefix.PREFIX_NAME).exists()
    assert check(d, qwen3_dir).rebuilt == 0


def truth(directory, fp, q, start=0):
    """The ranking of every artifact read from its own file, no index involved."""
    from kvcdn_core.search.index import _entry_from_file

    entries = [_entry_from_file(p, os.stat(p)) for p in sorted(Path(directory).rglob("*.kv"))]
    return rows(search.rank(entries, fp, q, start))


def replace_over(d, qwen3_dir, tmp_path):
    write_fake(tmp_path / "new.kv", qwen3_dir, OTHER[:280])
    os.rename(tmp_path / "new.kv", d / "sub" / "c.kv")


def rewrite_in_place(d, qwen3_dir, tmp_path):
    write_fake(tmp_path / "new.kv", qwen3_dir, OTHER[:280])
    with open(d / "a.kv", "r+b") as fh:
        fh.write((tmp_path / "new.kv").read_bytes())
        fh.truncate()


def restore_an_old_directory_index(d, qwen3_dir, tmp_path):
    old = (d / search.INDEX_NAME).read_bytes()
    write_fake(d / "a.kv", qwen3_dir, OTHER[:280])
    scan(d)
    (d / search.INDEX_NAME).write_bytes(old)  # in place, as a copy tool would


@pytest.mark.parametrize(
    "change",
    [
        lambda d, m, t: write_fake(t / "new.kv", m, DOC[:420]) or os.rename(t / "new.kv", d / "sub" / "n.kv"),
        lambda d, m, t: (d / "b.kv").unlink(),
        replace_over,
        rewrite_in_place,
        lambda d, m, t: os.rename(d / "sub" / "c.kv", d / "c.kv"),
        lambda d, m, t: shutil.rmtree(d / "sub"),
        restore_an_old_directory_index,
    ],
    ids=["added", "removed", "replaced", "rewritten-in-place", "moved", "directory-removed", "old-index-restored"],
)
def test_a_change_behind_kvcdns_back_is_seen(tmp_path, qwen3_dir, change):
    """The kept files are proved current per directory (a directory index read whole counts as the
    digest of its table): any change made without kvcdn still gives the ranking of the files."""
    d = tmp_path / "kv"
    write_fake(d / "a.kv", qwen3_dir, DOC[:300])
    write_fake(d / "b.kv", qwen3_dir, DOC[:100] + OTHER[100:200])
    write_fake(d / "sub" / "c.kv", qwen3_dir, DOC[:500])
    fp = fingerprint(qwen3_dir)
    check(d, qwen3_dir)
    assert check(d, qwen3_dir).rebuilt == 0  # both kept files current
    (tmp_path / "t").mkdir()
    change(d, qwen3_dir, tmp_path / "t")
    for _ in range(2):  # the search that sees the change, then one reading what it rewrote
        index = prefix.open_index(d, scan(d))
        for q in [*QUERIES, OTHER[:290] + [1]]:
            for start in (0, 1):
                assert rows(index.rank(fp, q, start)) == truth(d, fp, q, start)


def test_identity_is_one_digest_per_unchanged_directory(tmp_path, qwen3_dir):
    from kvcdn_core.search.index import identity

    d = tmp_path / "kv"
    for i in range(4):
        write_fake(d / f"a{i}.kv", qwen3_dir, DOC[: 50 * (i + 1)])
    scan(d)
    base = os.path.join(str(d), "")
    entries = scan(d)
    assert identity(entries, base) == identity(scan(d), base)  # read whole: the same digest
    # a part of a directory, or its entries in another order, is described entry by entry
    assert identity(entries[1:], base) != identity(entries, base)
    assert identity(entries[::-1], base) != identity(entries, base)
    os.utime(d / "a2.kv", ns=(1, 1))
    assert identity(scan(d), base) != identity(entries, base)


def test_a_search_through_the_index_reads_the_ids_of_its_candidates_only(tmp_path, qwen3_dir):
    d = tmp_path / "kv"
    for i in range(3):
        write_fake(d / f"doc{i}.kv", qwen3_dir, DOC[: 100 * (i + 1)])
        write_fake(d / f"other{i}.kv", qwen3_dir, OTHER[: 100 * (i + 1)])
    check(d, qwen3_dir)
    entries = scan(d)
    index = prefix.open_index(d, entries)
    assert index.rebuilt == 0 and not [e.name for e in entries if e._ids is not None]
    found = index.rank(fingerprint(qwen3_dir), DOC[:250], 0)
    assert sorted(e.name for e in entries if e._ids is not None) == ["doc0.kv", "doc1.kv", "doc2.kv"]
    assert [(m.path.name, m.prefix_tokens) for m in found.matches] == [
        ("doc2.kv", 250),
        ("doc1.kv", 200),
        ("doc0.kv", 100),
    ]
    assert rows(found) == rows(search.rank(entries, fingerprint(qwen3_dir), DOC[:250], 0))


def test_a_directory_index_cut_short_after_the_scan_gives_the_artifacts_own_ids(tmp_path, qwen3_dir):
    d = tmp_path / "kv"
    write_fake(d / "a.kv", qwen3_dir, DOC[:300])
    write_fake(d / "b.kv", qwen3_dir, OTHER[:200])
    scan(d)
    entries = scan(d)  # ids left in the index file
    with open(d / search.INDEX_NAME, "r+b") as fh:  # cut in place, behind kvcdn's back
        fh.truncate(100)
    assert [e.ids.tolist() for e in entries] == [DOC[:300], OTHER[:200]]


def test_entries_read_their_ids_with_few_index_files_open(tmp_path, qwen3_dir, monkeypatch):
    """A tree of many directories: the scan keeps a few index files open; one closed is reopened if
    it is the file the scan read, and an index renamed over it meanwhile sends its entries to the
    artifacts themselves."""
    from kvcdn_core.search import index as search_index

    monkeypatch.setattr(search_index, "_OPEN_MAX", 2)
    d = tmp_path / "kv"
    for i in range(5):
        write_fake(d / f"s{i}" / "a.kv", qwen3_dir, DOC[: 40 * (i + 1)])
    scan(d)
    entries = scan(d)
    assert len(search_index._open) == 2
    write_fake(d / "s1" / "b.kv", qwen3_dir, OTHER[:30])
    scan(d / "s1")  # rewrites s1's index: a new file renamed over the one the scan read
    reads: list[str] = []
    read_token_ids = search_index.artifact.read_token_ids
    monkeypatch.setattr(
        search_index.artifact,
        "read_token_ids",
        lambda p, *a: reads.append(Path(p).parent.name) or read_token_ids(p, *a),
    )
    assert [e.ids.tolist() for e in entries] == [DOC[: 40 * (i + 1)] for i in range(5)]
    assert reads == ["s1"]  # the others were read from their index files, reopened
    assert len(search_index._open) == 2


def test_an_entry_pickles_with_its_ids_not_its_index_file(tmp_path, qwen3_dir):
    import pickle

    d = tmp_path / "kv"
    write_fake(d / "a.kv", qwen3_dir, DOC[:300])
    scan(d)
    (entry,) = scan(d)
    copy = pickle.loads(pickle.dumps(entry))
    assert copy._source is None and copy.ids.tolist() == DOC[:300]
    assert (copy.path, copy.size, copy.ino, copy.model) == (entry.path, entry.size, entry.ino, entry.model)
