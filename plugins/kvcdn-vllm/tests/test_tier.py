"""The connector's local tier without vLLM: byte budgets per level, least recently used first, pins
that eviction respects, a digest checked once where a chunk enters, a corrupted file dropped and
fetched again, and what survives a restart."""

from __future__ import annotations

import os

import blake3
import pytest
from kvcdn_vllm.tier import DISK, MEMORY, REMOTE, ChunkTier

from kvcdn_core.errors import ArtifactError


class Store:
    """Chunks by digest, counting fetches (the remote side of the tier)."""

    def __init__(self, count: int, size: int = 100):
        self.chunks = {}
        for i in range(count):
            data = bytes([i % 256]) * size
            self.chunks[blake3.blake3(data).hexdigest()] = data
        self.fetched: list[str] = []

    def fetch(self, digest):
        self.fetched.append(digest)
        return self.chunks.get(digest)

    @property
    def digests(self):
        return list(self.chunks)


def tier(store, tmp_path, memory=250, disk=450, warnings=None):
    return ChunkTier(store.fetch, memory, disk, tmp_path / "tier", (warnings if warnings is not None else []).append)


def test_levels_keep_to_their_budgets_least_recently_used_first(tmp_path):
    store = Store(6)
    t = tier(store, tmp_path)
    a, b, c, d, e, _ = store.digests
    assert [t.get(x, 100)[1] for x in (a, b)] == [REMOTE, REMOTE]
    assert t.get(a, 100) == (store.chunks[a], MEMORY)  # a is now the most recently used
    t.get(c, 100)  # memory holds 2 chunks of 100 bytes: b, the least recent, goes
    assert (t.in_memory(a), t.in_memory(b), t.in_memory(c)) == (True, False, True)
    assert t.memory_used == 200
    assert t.get(b, 100)[1] == DISK  # still on disk: not fetched again
    for x in (d, e):
        t.get(x, 100)
    assert t.disk_used <= 450 and not t.on_disk(a)  # disk holds 4: a was used least recently
    assert store.fetched == [a, b, c, d, e]


def test_pinned_chunks_are_never_evicted(tmp_path):
    store = Store(4)
    t = tier(store, tmp_path, memory=200, disk=200)
    a, b, c, d = store.digests
    t.pin([a, b])
    for x in (a, b, c, d):
        t.get(x, 100)
    assert t.in_memory(a) and t.in_memory(b) and t.on_disk(a) and t.on_disk(b)
    t.unpin([a, b])
    t.get(c, 100)
    t.get(d, 100)  # unpinned now: the least recent go
    assert not t.in_memory(a) and t.memory_used <= 200


def test_a_corrupted_file_is_dropped_and_fetched_again_after_a_restart(tmp_path):
    store = Store(2)
    a, b = store.digests
    first = tier(store, tmp_path)
    first.get(a, 100)
    first.get(b, 100)
    path = tmp_path / "tier" / a[:2] / a
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    warnings: list[str] = []
    second = tier(store, tmp_path, warnings=warnings)  # a restart: the disk level is found again
    assert second.on_disk(a) and second.on_disk(b)
    assert second.get(b, 100) == (store.chunks[b], DISK)
    assert second.get(a, 100) == (store.chunks[a], REMOTE)
    assert len(warnings) == 1 and "corrupted" in warnings[0] and a in warnings[0]
    assert path.read_bytes() == store.chunks[a]  # the good bytes replaced the bad file
    assert store.fetched == [a, b, a]


def test_a_chunk_is_hashed_once_where_it_enters(tmp_path, monkeypatch):
    from kvcdn_vllm import tier as module

    store = Store(1)
    (a,) = store.digests
    calls = []
    real = module.checked
    monkeypatch.setattr(module, "checked", lambda *args: calls.append(args[1]) or real(*args))
    t = tier(store, tmp_path, memory=0)  # no memory level: every later read is from disk
    for _ in range(3):
        t.get(a, 100)
    assert calls == [a]  # fetched and checked once; the file this process wrote is trusted


def test_the_store_lacking_or_corrupting_a_chunk_is_one_line(tmp_path):
    store = Store(1)
    (a,) = store.digests
    t = tier(store, tmp_path)
    with pytest.raises(ArtifactError, match="missing"):
        t.get("f" * 64, 100)
    store.chunks[a] = b"x" * 100
    with pytest.raises(ArtifactError, match="corrupted"):
        t.get(a, 100)

    def broken(digest):
        raise ConnectionError("connection refused\nmore")

    with pytest.raises(ArtifactError, match="^cannot fetch chunk .*: connection refused$"):
        ChunkTier(broken, 1000, 0, None, print).get(a, 100)


def test_a_disk_that_cannot_take_chunks_costs_one_line(tmp_path):
    store = Store(3)
    blocked = tmp_path / "tier"
    blocked.write_bytes(b"")  # a file where the directory should be: every write fails
    warnings: list[str] = []
    t = ChunkTier(store.fetch, 1000, 1000, blocked, warnings.append)
    for x in store.digests:
        assert t.get(x, 100)[1] == REMOTE
    assert len(warnings) == 1 and "cannot keep chunks" in warnings[0]
    assert os.path.isfile(blocked)
