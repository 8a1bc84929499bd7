"""The connector's local tier without vLLM: byte budgets per level, least recently used first, pins
that eviction respects, a digest checked once where a chunk enters, a corrupted file dropped and
fetched again, what survives a restart, disk copies written off the load path (a writer the
test runs by hand, so no test waits on a thread's timing), and killed writers' temporary files swept
at start."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import blake3
import pytest
from kvcdn_vllm.tier import (
    DISK,
    MEMORY,
    REMOTE,
    ChunkTier,
    DiskWriter,
    StandAside,
    TouchedBuffers,
    sweep_temp_files,
)

from kvcdn_core.errors import ArtifactError


class Store:
    """Chunks by digest, counting fetches (the remote side of the tier)."""

    def __init__(self, count: int, size: int = 100):
        self.chunks = {}
        for i in range(count):
            data = bytes([i % 256]) * size
            self.chunks[blake3.blake3(data).hexdigest()] = data
        self.fetched: list[str] = []

    def fetch(self, digest, into=None, landed=None):  # a source that returns its own bytes, as one may
        self.fetched.append(digest)
        return self.chunks.get(digest)

    @property
    def digests(self):
        return list(self.chunks)


class Manual:
    """The tier's disk writer, run by the test: jobs wait until :meth:`run`."""

    def __init__(self):
        self.jobs = []

    def submit(self, job):
        self.jobs.append(job)

    def run(self):
        while self.jobs:
            self.jobs.pop(0)()

    close = run


class Inline(Manual):
    """Every disk copy written as it is queued (the level tests below need no other timing)."""

    def submit(self, job):
        job()


def tier(store, tmp_path, memory=250, disk=450, warnings=None, writer=None, **more):
    log = (warnings if warnings is not None else []).append
    return ChunkTier(store.fetch, memory, disk, tmp_path / "tier", log, writer or Inline(), **more)


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


def test_a_restart_warms_memory_from_disk_checking_each_file_and_evicting_nothing(tmp_path):
    store = Store(5)
    a, b, c, d, e = store.digests
    first = tier(store, tmp_path, memory=0, disk=1000)
    for x in (a, b, c, d, e):  # the disk's last-use order: a first, e last
        first.get(x, 100)
    path = tmp_path / "tier" / d[:2] / d
    path.write_bytes(b"\xff" + path.read_bytes()[1:])
    warnings: list[str] = []
    second = tier(store, tmp_path, memory=350, disk=1000, warnings=warnings)
    assert second.get(a, 100)[1] == DISK  # a request before warming: a is in memory now, the most recent
    assert second.warm() == 1  # the free 250 bytes: e and d, the most recent not in memory; d is corrupted
    assert len(warnings) == 1 and "corrupted" in warnings[0] and d in warnings[0]
    assert (second.in_memory(a), second.in_memory(e), second.in_memory(d)) == (True, True, False)
    assert second.get(e, 100) == (store.chunks[e], MEMORY)
    assert second.get(d, 100) == (store.chunks[d], REMOTE)  # dropped, fetched again
    assert second.get(c, 100)[1] == DISK  # over the free budget: left on disk
    assert second.warm() == 0 and second.memory_used <= 350

    third = tier(store, tmp_path, memory=1000, disk=1000)
    third.start_warming()  # the engine's way: one background thread
    assert third._warming is not None
    third._warming.join()
    assert third.warmed == 5 and [third.get(x, 100)[1] for x in store.digests] == [MEMORY] * 5
    third.close()
    assert store.fetched == [a, b, c, d, e, d]


class IntoStore(Store):
    """A source that reads each chunk into the memory the tier hands it, as the real ones do."""

    def fetch(self, digest, into=None, landed=None):
        data = super().fetch(digest)
        if data is None or len(data) != len(into):
            return data
        into[:] = data
        if landed is not None:
            landed(len(into))
        return into


def ready(buffers, count):
    """Wait for the filling thread (it runs at a lower priority): a bound that only a hang reaches."""
    deadline = time.monotonic() + 120
    while buffers.ready < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return buffers.ready


def test_a_fetched_chunk_lands_in_a_ready_buffer_and_the_reserve_refills(tmp_path):
    store = IntoStore(3, size=100)
    a, b, c = store.digests
    buffers = TouchedBuffers(100, 2)
    assert ready(buffers, 2) == 2
    made = {id(x) for x in buffers._ready}
    t = ChunkTier(store.fetch, 1000, 0, None, print, Inline(), buffers=buffers)
    data, where = t.get(a, 100)
    assert (bytes(data), where) == (store.chunks[a], REMOTE)
    assert isinstance(data, memoryview) and id(data.obj) in made and buffers.taken == 1
    assert ready(buffers, 2) == 2  # refilled in the background
    assert t.get(a, 100) == (data, MEMORY)  # the memory level keeps that very buffer
    small = Store(1, size=40)  # a piece of under half a buffer: new memory, no buffer wasted on it
    (p,) = small.digests
    store.chunks[p] = small.chunks[p]
    assert bytes(t.get(p, 40)[0]) == small.chunks[p] and buffers.taken == 1
    bad = bytes([7]) * 100  # a store holding other bytes: refused, and the buffer not kept
    store.chunks[c] = bad
    with pytest.raises(ArtifactError, match="corrupted"):
        t.get(c, 100)
    assert not t.in_memory(c)
    t.close()
    assert buffers.ready == 0  # closing the tier lets the ready buffers go


def until(predicate):
    """Wait for a background thread to get somewhere: a bound that only a hang reaches."""
    deadline = time.monotonic() + 120
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_background_work_stands_aside_while_loads_are_held_and_goes_on_after(tmp_path):
    """Disk copies, buffer refills and warming wait while a step's loads are in flight."""
    store = IntoStore(4, size=100)
    a, b, c, d = store.digests
    aside = StandAside(longest_s=600)  # only the release lets them go here
    buffers = TouchedBuffers(100, 1, aside)
    assert ready(buffers, 1) == 1
    t = ChunkTier(store.fetch, 1000, 1000, tmp_path / "tier", print, buffers=buffers, stand_aside=aside)
    aside.hold()
    assert bytes(t.get(a, 100)[0]) == store.chunks[a]  # the load itself never waits
    assert until(lambda: aside.waiting == 2)  # the refill and the disk copy, each standing aside
    assert buffers.ready == 0 and not t.on_disk(a)
    aside.release()
    assert ready(buffers, 1) == 1 and until(lambda: t.on_disk(a))
    t.close()
    # warming a restarted tier stands aside too
    aside = StandAside(longest_s=600)
    again = ChunkTier(store.fetch, 1000, 1000, tmp_path / "tier", print, stand_aside=aside)
    aside.hold()
    again.start_warming()
    assert until(lambda: aside.waiting == 1)
    assert again.warmed == 0 and not again.in_memory(a)
    aside.release()
    assert until(lambda: again.in_memory(a))
    again.close()


def test_background_work_waits_for_held_loads_at_most_its_longest():
    """An engine that loads in every step still gets its disk copies, later."""
    aside = StandAside(longest_s=0)
    aside.hold()
    ran = []
    writer = DiskWriter(print, stand_aside=aside)
    writer.submit(lambda: ran.append(1))
    assert until(lambda: ran == [1])  # ran, though the hold was never released
    writer.close()


def test_background_work_goes_on_once_every_holder_released():
    """A step's load and the scheduler's lookup hold it each for itself (one process, one tier)."""
    aside = StandAside(longest_s=600)
    aside.hold("load")
    aside.hold("lookup")
    went = threading.Event()
    threading.Thread(target=lambda: (aside.wait(), went.set()), daemon=True).start()
    assert until(lambda: aside.waiting == 1)
    aside.release("load")
    aside.release("load")  # a second release of the same holder changes nothing
    assert aside.held and not went.is_set()
    aside.release("lookup")
    assert not aside.held and went.wait(120)


def test_a_closing_tier_excuses_its_own_background_work_only(tmp_path):
    """Two tiers of one process share its StandAside: closing one lets its queued disk copy go at
    once and leaves the holds, so the other's background work still stands aside."""
    store = IntoStore(2, size=100)
    a, b = store.digests
    aside = StandAside(longest_s=600)  # only a release or a close lets them go here
    closing = ChunkTier(store.fetch, 1000, 1000, tmp_path / "one", print, stand_aside=aside)
    staying = ChunkTier(store.fetch, 1000, 1000, tmp_path / "two", print, stand_aside=aside)
    aside.hold("another engine's load")
    closing.get(a, 100)
    staying.get(b, 100)
    assert until(lambda: aside.waiting == 2)  # both disk copies stand aside
    closing.close()  # returns once its copy is written, though the hold stays
    assert closing.on_disk(a) and aside.held
    assert aside.waiting == 1 and not staying.on_disk(b)
    aside.release("another engine's load")
    assert until(lambda: staying.on_disk(b))
    staying.close()


class HoldAtFirstPause(StandAside):
    """Held by the first pause between two pieces of a unit of work: as if a load began mid-way."""

    def __init__(self):
        super().__init__(longest_s=600)  # only the release lets the work go on here
        self.pieces_paused = 0

    def pauses(self, excused=None):
        inner = super().pauses(excused)

        def pause():
            self.pieces_paused += 1
            if self.pieces_paused == 1:
                self.hold()
            inner()

        return pause


def test_a_disk_copy_stands_aside_between_its_pieces(tmp_path, monkeypatch):
    """A load that starts while a chunk is being written waits for one piece of it, not all."""
    from kvcdn_vllm import tier as tier_module

    monkeypatch.setattr(tier_module, "BACKGROUND_STEP", 100)
    store = IntoStore(1, size=250)  # three pieces: 100, 100, 50 bytes
    (a,) = store.digests
    aside = HoldAtFirstPause()
    t = ChunkTier(store.fetch, 1000, 1000, tmp_path / "tier", print, stand_aside=aside)
    assert bytes(t.get(a, 250)[0]) == store.chunks[a]
    assert until(lambda: aside.waiting == 1)  # held after the first piece
    temporary = list((tmp_path / "tier").rglob(".*.tmp"))
    assert not t.on_disk(a) and len(temporary) == 1
    assert until(lambda: temporary[0].stat().st_size == 100)  # written piece by piece, not at once
    aside.release()
    assert until(lambda: t.on_disk(a))
    assert (tmp_path / "tier" / a[:2] / a).read_bytes() == store.chunks[a]
    assert aside.pieces_paused == 2
    t.close()


def test_a_buffers_first_writes_stand_aside_between_their_pieces(monkeypatch):
    from kvcdn_vllm import tier as tier_module

    monkeypatch.setattr(tier_module, "BACKGROUND_STEP", 4096)
    aside = HoldAtFirstPause()
    buffers = TouchedBuffers(3 * 4096, 1, aside)
    assert until(lambda: aside.waiting == 1)  # the first page written, then held
    assert buffers.ready == 0
    aside.release()
    assert ready(buffers, 1) == 1 and aside.pieces_paused == 2
    buffers.close()


def test_the_pauses_of_one_unit_of_work_wait_until_the_longest_after_its_start():
    now = [0.0]
    aside = StandAside(longest_s=600, clock=lambda: now[0])
    aside.hold()
    pause = aside.pauses()
    went = threading.Event()
    waiting = threading.Thread(target=lambda: (pause(), went.set()), daemon=True)
    waiting.start()
    assert until(lambda: aside.waiting == 1) and not went.is_set()  # held: it waits
    aside.release()
    assert went.wait(120)
    aside.hold()
    now[0] = 600.0  # the unit's whole budget spent: its next pauses go at once, though held
    later = threading.Thread(target=lambda: (pause(), pause()), daemon=True)
    later.start()
    later.join(120)  # a bound on a failure only
    assert not later.is_alive()


def test_the_reserve_is_an_eighth_of_the_memory_budget_at_most_256_mib():
    counts = []
    for budget in (1 << 30, 4 << 30, 0):
        buffers = TouchedBuffers.for_budget(12 << 20, budget)
        buffers.close()  # only the count is asked here, not the memory
        counts.append(buffers.count)
    assert counts == [10, 21, 0]  # 128 MiB of 12 MiB buffers; the 256 MiB cap; no memory level, none


def test_a_chunk_checked_later_enters_the_tier_only_once_admitted(tmp_path):
    store = Store(3)
    a, b, c = store.digests
    t = tier(store, tmp_path, memory=1000, disk=1000)
    assert t.get(a, 100, check_later=True) == (store.chunks[a], REMOTE)
    assert t.unchecked(a) and not t.in_memory(a) and not t.on_disk(a)  # nowhere in the tier yet
    assert t.get(a, 100, check_later=True) == (store.chunks[a], MEMORY)  # another request of the step
    t.admit(a, 100)
    assert not t.unchecked(a) and t.in_memory(a) and t.on_disk(a)
    store.chunks[c] = bytes([9]) * 100  # the store holds other bytes under c's name
    assert t.get(c, 100, check_later=True)[1] == REMOTE
    with pytest.raises(ArtifactError, match="corrupted"):
        t.admit(c, 100)
    assert not (t.unchecked(c) or t.in_memory(c) or t.on_disk(c))  # dropped: never served again unchecked
    t.get(b, 100, check_later=True)
    assert t.get(b, 100) == (store.chunks[b], MEMORY)  # a request that needs it checked now: checked first
    assert not t.unchecked(b) and t.in_memory(b)
    assert store.fetched == [a, c, b]


def test_chunks_from_the_store_are_fetched_several_at_once_each_error_in_its_place(tmp_path):
    import threading

    from kvcdn_vllm.tier import FETCH_STREAMS

    class Gated(Store):
        gate: threading.Barrier | None = None

        def fetch(self, digest, into=None, landed=None):
            if self.gate is not None:
                self.gate.wait()
            return super().fetch(digest, into)

    store = Gated(FETCH_STREAMS + 2)
    *fetched, held = store.digests
    t = tier(store, tmp_path, memory=10_000, disk=10_000)
    t.get(held, 100)
    store.fetched.clear()
    store.gate = threading.Barrier(FETCH_STREAMS, timeout=120)  # broken only if the fetches run one by one
    missing = "f" * 64
    wanted = [(d, 100) for d in fetched[: FETCH_STREAMS - 1]] + [(missing, 100), (held, 100), (fetched[0], 100)]
    arrivals = t.arrive_all(wanted)
    assert arrivals[-1] is arrivals[0]  # a repeat is one arrival
    with pytest.raises(ArtifactError, match="missing"):
        arrivals[FETCH_STREAMS - 1].wait(100)
    got = [a.wait(100) for i, a in enumerate(arrivals) if i != FETCH_STREAMS - 1]
    assert got == [store.chunks[d] for d, _ in wanted if d != missing]
    assert [a.where for a in arrivals] == [REMOTE] * (FETCH_STREAMS - 1) + [None, MEMORY, REMOTE]
    assert sorted(store.fetched) == sorted(fetched[: FETCH_STREAMS - 1] + [missing])  # a repeat fetched once
    assert all(t.unchecked(d) for d in fetched[: FETCH_STREAMS - 1])  # what did come is still checked later
    t.close()


class Halves(Store):
    """Reads each chunk into the tier's memory in two halves: the first lands at once, the second
    once ``rest`` is set; with ``fail`` it never comes (the fetch raises, as a dropped connection)."""

    def __init__(self, count: int):
        super().__init__(0)
        for i in range(count):
            data = bytes((i * 31 + j) % 256 for j in range(100))
            self.chunks[blake3.blake3(data).hexdigest()] = data
        self.rest = threading.Event()
        self.fail = False
        self.long = False

    def fetch(self, digest, into=None, landed=None):
        data = super().fetch(digest)
        into[:] = data
        landed(50)
        if self.fail:
            raise OSError("the connection dropped")
        assert self.rest.wait(120)  # a bound only a reader that waits for every byte reaches
        landed(100)
        return data + b"!" if self.long else into


def test_a_fetched_chunk_is_readable_as_its_bytes_land(tmp_path):
    store = Halves(2)
    a, b = store.digests
    t = tier(store, tmp_path, memory=1000, disk=1000)
    first, second = t.arrive_all([(a, 100), (b, 100)])  # returned at once, both fetches under way
    assert bytes(first.wait(50)[:50]) == store.chunks[a][:50]  # the front, while the rest is held
    assert bytes(second.wait(40)[:40]) == store.chunks[b][:40]
    assert not first.settled and first.where is None and not t.unchecked(a)
    store.rest.set()
    assert bytes(first.wait(100)) == store.chunks[a] and bytes(second.wait(100)) == store.chunks[b]
    for arrival in (first, second):  # every byte landed; the fetch then ends and the arrival settles
        arrival.wait_settled()
        assert arrival.where == REMOTE
    assert t.unchecked(a) and not t.in_memory(a)  # arrived, not yet checked: admit checks it
    t.admit(a, 100)
    t.admit(b, 100)
    assert t.in_memory(a) and t.in_memory(b) and sorted(store.fetched) == sorted([a, b])
    again = t.arrive_all([(a, 100)])[0]  # from memory: settled as it is handed out
    assert again.settled and again.where == MEMORY
    t.close()


def test_admit_waits_for_the_end_of_a_fetch_whose_bytes_all_landed(tmp_path):
    """A stream's last byte lands before its end is read (a body longer than planned is refused only
    then): the check waits for the fetch to be over, so it never runs on half the story."""

    class Tail(Store):
        gate = threading.Event()

        def fetch(self, digest, into=None, landed=None):
            into[:] = b"\x01" * 100  # not the chunk's bytes: the check must catch them
            landed(100)
            assert self.gate.wait(120)
            return into

    store = Tail(1)
    (a,) = store.digests
    t = tier(store, tmp_path, memory=1000, disk=1000)
    arrival = t.arrive_all([(a, 100)])[0]
    arrival.wait(100)  # every byte is in place, the fetch not over
    outcome: list[BaseException | None] = []

    def admit():
        try:
            t.admit(a, 100)
            outcome.append(None)
        except ArtifactError as exc:
            outcome.append(exc)

    checking = threading.Thread(target=admit)
    checking.start()
    checking.join(0.2)
    assert checking.is_alive() and not outcome  # waiting for the fetch's end, not done without a check
    store.gate.set()
    checking.join(120)
    assert len(outcome) == 1 and "corrupted" in str(outcome[0])
    assert not (t.unchecked(a) or t.in_memory(a))
    t.close()


def test_a_fetch_that_stops_halfway_fails_its_arrival_after_its_front_came(tmp_path):
    store = Halves(1)
    (a,) = store.digests
    t = tier(store, tmp_path, memory=1000, disk=1000)
    store.fail = True
    arrival = t.arrive_all([(a, 100)])[0]
    with pytest.raises(ArtifactError, match=f"cannot fetch chunk {a} from the store: the connection dropped"):
        arrival.wait(100)
    with pytest.raises(ArtifactError, match="the connection dropped"):
        arrival.wait(10)  # failed: not even the front is handed out any more
    t.admit(a, 100)  # nothing arrived whole: nothing to check or keep
    assert not (t.unchecked(a) or t.in_memory(a) or t.on_disk(a))
    store.fail, store.long = False, True  # the store then sends one byte too many
    store.rest.set()
    arrival = t.arrive_all([(a, 100)])[0]
    with pytest.raises(ArtifactError, match="a chunk of 100 bytes came as 101"):
        arrival.wait_settled()  # its 100 bytes landed; the fetch's end says there were more
    with pytest.raises(ArtifactError, match="corrupted"):  # the fetch is over: its 101 bytes checked
        t.admit(a, 100)
    assert arrival.where is None and not t.unchecked(a)  # dropped, not served to the next load
    store.long = False
    assert bytes(t.arrive_all([(a, 100)])[0].wait(100)) == store.chunks[a]  # fetched again, whole
    assert store.fetched == [a, a, a]
    t.close()


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

    def broken(digest, into):
        raise ConnectionError("connection refused\nmore")

    with pytest.raises(ArtifactError, match="^cannot fetch chunk .*: connection refused$"):
        ChunkTier(broken, 1000, 0, None, print).get(a, 100)


def test_a_disk_that_cannot_take_chunks_costs_one_line(tmp_path):
    store = Store(3)
    blocked = tmp_path / "tier"
    blocked.write_bytes(b"")  # a file where the directory should be: every write fails
    warnings: list[str] = []
    t = ChunkTier(store.fetch, 1000, 1000, blocked, warnings.append, Inline())
    for x in store.digests:
        assert t.get(x, 100)[1] == REMOTE
    assert len(warnings) == 1 and "cannot keep chunks" in warnings[0]
    assert os.path.isfile(blocked)


def test_a_fetched_chunk_is_served_before_its_disk_copy_is_written(tmp_path):
    store = Store(1)
    (a,) = store.digests
    writer = Manual()
    t = tier(store, tmp_path, memory=0, writer=writer)  # no memory level: only the queued bytes hold it
    path = tmp_path / "tier" / a[:2] / a
    assert t.get(a, 100) == (store.chunks[a], REMOTE)  # the writer has not run: the load did not wait
    assert not t.on_disk(a) and not path.exists()
    assert t.get(a, 100) == (store.chunks[a], MEMORY)  # the bytes waiting for the writer, not a new fetch
    writer.run()
    assert t.on_disk(a) and path.read_bytes() == store.chunks[a]
    assert t.get(a, 100) == (store.chunks[a], DISK)
    assert store.fetched == [a]
    assert [p.name for p in path.parent.iterdir()] == [a]  # no temporary file left


def test_a_full_write_queue_drops_the_disk_copy_never_the_load(tmp_path):
    store = Store(5)
    a, b, c, d, e = store.digests
    writer, warnings = Manual(), []
    t = tier(store, tmp_path, memory=1000, disk=1000, warnings=warnings, writer=writer, write_queue_bytes=250)
    assert [t.get(x, 100)[1] for x in (a, b, c, d)] == [REMOTE] * 4  # none waited for the disk
    assert t.disk_dropped == 2
    assert len(warnings) == 1 and "fall behind" in warnings[0]
    writer.run()
    assert [t.on_disk(x) for x in (a, b, c, d)] == [True, True, False, False]
    assert t.get(c, 100)[1] == MEMORY  # a dropped copy: the chunk is still served from memory
    t.get(e, 100)  # the queue has room again
    writer.run()
    assert t.on_disk(e) and len(warnings) == 1


def test_the_writer_evicts_least_recent_but_never_a_pinned_chunk(tmp_path):
    store = Store(3)
    a, b, c = store.digests
    writer = Manual()
    t = tier(store, tmp_path, memory=0, disk=200, writer=writer)
    t.get(a, 100)
    t.get(b, 100)
    writer.run()
    t.pin([a])  # a request in flight holds a, the least recently used
    t.get(c, 100)
    writer.run()  # c's copy takes b's place, not a's
    assert (t.on_disk(a), t.on_disk(b), t.on_disk(c)) == (True, False, True)
    assert t.disk_used == 200


def test_the_writer_thread_leaves_every_chunk_for_a_restart(tmp_path):
    store = Store(4)
    warnings: list[str] = []
    first = ChunkTier(store.fetch, 0, 1000, tmp_path / "tier", warnings.append)
    assert [first.get(x, 100)[1] for x in store.digests] == [REMOTE] * 4
    first.close()  # an engine's shutdown: waits for the queued copies
    assert all(first.on_disk(x) for x in store.digests)
    assert not list((tmp_path / "tier").rglob(".*.tmp"))
    second = ChunkTier(store.fetch, 0, 1000, tmp_path / "tier", warnings.append)
    assert [second.get(x, 100) for x in store.digests] == [(store.chunks[x], DISK) for x in store.digests]
    assert store.fetched == store.digests and warnings == []


def test_a_half_written_file_is_never_taken_for_a_chunk(tmp_path):
    store = Store(1)
    (a,) = store.digests
    folder = tmp_path / "tier" / a[:2]
    folder.mkdir(parents=True)
    (folder / f".{a}.4242.1.tmp").write_bytes(store.chunks[a][:50])  # a writer killed mid-copy
    t = tier(store, tmp_path)
    assert not t.on_disk(a)
    assert t.get(a, 100) == (store.chunks[a], REMOTE)


def test_the_disk_writer_runs_jobs_in_order_and_survives_a_failing_one():
    warnings: list[str] = []
    done: list[int] = []
    writer = DiskWriter(warnings.append)
    writer.submit(lambda: done.append(1))
    writer.submit(lambda: 1 / 0)
    writer.submit(lambda: done.append(2))
    writer.close()
    assert done == [1, 2]
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0]
    writer.submit(lambda: done.append(3))  # a job after close starts the thread again
    writer.close()
    assert done == [1, 2, 3]


def test_loads_on_several_threads_and_the_writer_keep_the_budgets(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    store = Store(12)
    t = ChunkTier(store.fetch, 300, 500, tmp_path / "tier", print)
    order = [d for _ in range(5) for d in store.digests]
    with ThreadPoolExecutor(2) as pool:  # as the connector's fetch threads ask it
        got = list(pool.map(lambda d: t.get(d, 100)[0], order))
    t.close()
    assert got == [store.chunks[d] for d in order]
    files = [p for p in (tmp_path / "tier").rglob("*") if p.is_file()]
    assert t.memory_used <= 300 and t.disk_used == 100 * len(files) <= 500
    assert all(store.chunks[p.name] == p.read_bytes() and t.on_disk(p.name) for p in files)


def test_warming_beside_loads_on_several_threads_keeps_every_byte_and_the_budget(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    store = IntoStore(16)
    first = ChunkTier(store.fetch, 0, 2000, tmp_path / "tier", print)
    for d in store.digests:
        first.get(d, 100)
    first.close()  # the disk level holds all 16 for the restart
    flip = store.digests[5]
    path = tmp_path / "tier" / flip[:2] / flip
    path.write_bytes(b"\x00" + path.read_bytes()[1:])  # one file corrupted meanwhile
    store.fetched.clear()
    warnings: list[str] = []
    buffers = TouchedBuffers(100, 4)
    t = ChunkTier(store.fetch, 900, 2000, tmp_path / "tier", warnings.append, buffers=buffers)
    order = [d for _ in range(3) for d in reversed(store.digests)]
    t.start_warming()  # beside the loads, as at an engine's start
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda d: bytes(t.get(d, 100)[0]), order))
    t.close()
    assert got == [store.chunks[d] for d in order]  # every byte, whoever read each chunk first
    assert t.memory_used <= 900
    assert all(t.in_memory(d) is False or bytes(t.get(d, 100)[0]) == store.chunks[d] for d in store.digests)
    # the corrupted file is caught (by the warming or by a load, whichever reads it first; both at
    # once may each say so) and the chunk fetched again; nothing else is
    assert set(store.fetched) == {flip} and warnings and all(flip in w and "corrupted" in w for w in warnings)
    assert path.read_bytes() == store.chunks[flip]  # the good bytes replaced the corrupted file


def dead_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def temp_file(folder, digest: str, pid: int, written: float):
    """A writer's temporary file, named as :meth:`ChunkTier._write_file` names it, last written at ``written``."""
    path = folder / f".{digest}.{pid}.140000000000.tmp"
    path.write_bytes(b"x" * 50)
    os.utime(path, (written, written))
    return path


def test_temp_files_of_a_killed_writer_are_swept_at_start(tmp_path):
    store = Store(1)
    (a,) = store.digests
    folder = tmp_path / "tier" / a[:2]
    folder.mkdir(parents=True)
    (folder / a).write_bytes(store.chunks[a])  # a chunk an earlier run left
    gone, now = dead_pid(), time.time()
    killed = temp_file(folder, a, gone, now - 600)  # its writer died mid-copy
    live = temp_file(folder, a, os.getppid(), now - 600)  # another engine's writer, still running
    other = folder / f".{a}.tmp"  # not the tier's pattern
    other.write_bytes(b"")
    outside = tmp_path / "elsewhere" / a[:2]  # not the tier's directory
    outside.mkdir(parents=True)
    foreign = temp_file(outside, a, gone, now - 600)
    warnings: list[str] = []
    t = tier(store, tmp_path, warnings=warnings)
    assert not killed.exists() and t.temp_swept == 1
    assert live.exists() and other.exists() and foreign.exists()
    assert t.on_disk(a) and t.disk_used == 100  # the budget counts chunks only, as before
    assert t.get(a, 100) == (store.chunks[a], DISK) and warnings == []


def test_which_temp_files_count_as_stale(tmp_path):
    folder = tmp_path / "ab"
    folder.mkdir()
    a, b, c, d = ("ab" + str(i) * 62 for i in range(4))
    gone, now = dead_pid(), 1_000_000.0
    fresh = temp_file(folder, a, gone, now - 10)  # a writer in another pid namespace may own it
    old = temp_file(folder, b, gone, now - 120)
    reused = temp_file(folder, c, os.getpid(), now - 7200)  # pid alive again, but no copy takes an hour
    mine = temp_file(folder, d, os.getpid(), now - 120)
    assert sweep_temp_files(tmp_path, now) == 2
    assert (fresh.exists(), old.exists(), reused.exists(), mine.exists()) == (True, False, False, True)
    assert sweep_temp_files(tmp_path / "missing", now) == 0


def test_a_chunk_read_from_disk_keeps_its_bytes_when_its_file_is_deleted_or_replaced(tmp_path):
    """Disk reads are mapped, not copied (a fresh engine's load paid most for first touches of new
    memory): a chunk handed to a load keeps the bytes it was checked with, whatever happens to its
    file after, since the tier only renames files into place and deletes them."""
    store = Store(3)
    a, b, c = store.digests
    first = tier(store, tmp_path)
    for x in (a, b, c):
        first.get(x, 100)
    second = tier(store, tmp_path, memory=100)  # a restart; memory holds one chunk
    got_a, where = second.get(a, 100)
    assert (got_a, where) == (store.chunks[a], DISK)
    got_b, _ = second.get(b, 100)
    path_a, path_b = (tmp_path / "tier" / x[:2] / x for x in (a, b))
    path_a.unlink()  # an eviction (or another engine sharing the directory) deletes a's file
    other = path_b.with_name(".other")
    other.write_bytes(b"\x00" * 100)
    os.replace(other, path_b)  # and a writer renames other bytes over b's
    assert bytes(got_a) == store.chunks[a] and bytes(got_b) == store.chunks[b]
    third = tier(store, tmp_path, warnings=(warnings := []))  # what a later start finds: b is dropped
    assert third.get(b, 100) == (store.chunks[b], REMOTE)
    assert len(warnings) == 1 and "corrupted" in warnings[0]


def test_an_empty_file_in_the_tier_is_dropped_and_fetched_again(tmp_path):
    store = Store(1)
    (a,) = store.digests
    folder = tmp_path / "tier" / a[:2]
    folder.mkdir(parents=True)
    (folder / a).write_bytes(b"")  # a disk that filled up under another program's writer
    t = tier(store, tmp_path, warnings=(warnings := []))
    assert t.on_disk(a)
    assert t.get(a, 100) == (store.chunks[a], REMOTE)
    assert len(warnings) == 1 and "corrupted" in warnings[0]
    assert (folder / a).read_bytes() == store.chunks[a]


#: another engine's tier on the same directory, in a process of its own: it fetches the chunks
#: given as hex and closes (its disk copies written)
PEER = """
import sys
from pathlib import Path

import blake3
from kvcdn_vllm.tier import ChunkTier

chunks = {blake3.blake3(data).hexdigest(): data for data in map(bytes.fromhex, sys.argv[2:])}
peer = ChunkTier(lambda digest, into: chunks[digest], 1000, 1000, Path(sys.argv[1]), print)
for digest, data in chunks.items():
    peer.get(digest, len(data))
peer.close()
"""


def test_a_chunk_another_process_wrote_since_start_is_read_from_disk_and_checked_once(tmp_path, monkeypatch):
    """Engines or tensor-parallel workers sharing a directory: a chunk one fetched after the other
    started is the other's from disk, not fetched again, checked once (its file could hold anything)
    and counted in the budget."""
    from kvcdn_vllm import tier as module

    store = Store(3)
    a, b, c = store.digests
    checks = []
    real = module.checked
    monkeypatch.setattr(module, "checked", lambda *args: checks.append(args[1]) or real(*args))
    t = tier(store, tmp_path, memory=0, disk=250, warnings=(warnings := []))  # no memory level
    t.get(c, 100)  # its own, fetched and written before the peer's
    folder = tmp_path / "tier"
    subprocess.run([sys.executable, "-c", PEER, str(folder), store.chunks[a].hex(), store.chunks[b].hex()], check=True)
    path_b = folder / b[:2] / b
    path_b.write_bytes(b"\x00" * 100)  # b's file damaged after the peer wrote it
    for _ in range(2):
        assert t.get(a, 100) == (store.chunks[a], DISK)
    assert t.get(b, 100) == (store.chunks[b], REMOTE)
    assert store.fetched == [c, b]
    assert checks == [c, a, b, b]  # c and b as fetched, a once as read, b's damaged file once
    assert len(warnings) == 1 and "corrupted" in warnings[0] and b in warnings[0]
    assert path_b.read_bytes() == store.chunks[b]
    assert t.disk_used == 200 and not t.on_disk(c) and not (folder / c[:2] / c).exists()  # c: least recent


def test_a_file_another_process_wrote_over_this_budget_is_not_taken(tmp_path):
    """Counting it would evict every other file of the directory, and still leave the level over
    its budget: the chunk is fetched and served from memory instead."""
    store = Store(2)
    a, b = store.digests
    big = bytes(range(256)) + bytes(44)
    c = blake3.blake3(big).hexdigest()
    store.chunks[c] = big
    t = tier(store, tmp_path, memory=1000, disk=250)
    t.get(a, 100)
    t.get(b, 100)
    folder = tmp_path / "tier" / c[:2]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / c).write_bytes(big)  # another engine's, of a larger budget
    assert t.get(c, 300) == (big, REMOTE)
    assert t.on_disk(a) and t.on_disk(b) and t.disk_used == 200 and not t.on_disk(c)
