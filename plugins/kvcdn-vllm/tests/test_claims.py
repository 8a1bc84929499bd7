"""Claims across processes on fetching a chunk into a shared tier directory: one claim at a time, a
waiter that reads the holder's file instead of fetching, a holder that fails or dies, leftovers
swept. The other processes are real ones (``flock`` is per open file, so a claim in this process
also excludes another of this process: used where a test needs to time the holder itself)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import blake3
import pytest
from kvcdn_vllm.claims import FetchClaims, claim_path, sweep_claims
from kvcdn_vllm.tier import DISK, REMOTE, ChunkTier, DiskWriter

DIGEST = "ab" + "0" * 62


def test_a_claim_waits_for_the_holder_and_holds_the_new_file_after_it(tmp_path):
    first = FetchClaims(tmp_path).claim(DIGEST)
    assert first is not None and not first.waited
    path = claim_path(tmp_path, DIGEST)
    assert path.exists()
    sleeps = []

    def sleep(seconds):  # the waiter's first pause: the holder lets go meanwhile
        sleeps.append(seconds)
        first.release()

    second = FetchClaims(tmp_path, sleep=sleep).claim(DIGEST)
    assert second is not None and second.waited and len(sleeps) == 1
    assert path.exists()  # the holder removed its file; the waiter holds a new one at the path
    third = FetchClaims(tmp_path, longest_wait_s=0, sleep=lambda s: None).claim(DIGEST)
    assert third is None  # held: nobody else gets it
    second.release()
    second.release()  # a second release changes nothing
    assert not path.exists()


def test_a_waiter_marks_each_holder_it_waits_for(tmp_path):
    """The mark tells the holder to write the chunk's file at once: a second holder, which took the
    path's new file while the waiter was between two tries, is marked too."""
    first = FetchClaims(tmp_path).claim(DIGEST)
    assert first is not None and not first.wanted
    seen = []

    def sleep(seconds):
        if not seen:  # the first holder lets go, and another process takes the claim first
            seen.append(first.wanted)
            first.release()
            seen.append(FetchClaims(tmp_path).claim(DIGEST))
        elif len(seen) == 2:
            second = seen[1]
            seen.append(second.wanted)
            second.release()

    waiter = FetchClaims(tmp_path, sleep=sleep).claim(DIGEST)
    assert waiter is not None and waiter.waited
    assert seen[0] is True and seen[2] is True  # both holders were marked
    assert not waiter.wanted  # its own file: nobody waits for it
    waiter.release()


def test_a_claim_held_past_the_longest_wait_is_given_up(tmp_path):
    holder = FetchClaims(tmp_path).claim(DIGEST)
    now = iter([0.0, 1.0, 2.0, 4.9, 5.0])
    sleeps = []
    waiter = FetchClaims(tmp_path, longest_wait_s=5.0, clock=lambda: next(now), sleep=sleeps.append)
    assert waiter.claim(DIGEST) is None
    assert len(sleeps) == 4
    assert holder is not None
    holder.release()


def test_a_directory_that_takes_no_claim_file_claims_nothing(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"")
    assert FetchClaims(blocked).claim(DIGEST) is None


#: holds the claim on the digest given until its stdin closes, then releases it
HOLDER = """
import sys
from pathlib import Path
from kvcdn_vllm.claims import FetchClaims
claim = FetchClaims(Path(sys.argv[1])).claim(sys.argv[2])
print("held" if claim is not None else "none", flush=True)
sys.stdin.read()
claim.release()
"""


def holder(directory: Path, digest: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), digest], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_killed_holders_claim_goes_with_it_and_its_file_is_swept_unless_held(tmp_path):
    other = "cd" + "1" * 62
    killed, alive = holder(tmp_path, DIGEST), holder(tmp_path, other)
    try:
        assert FetchClaims(tmp_path, longest_wait_s=0, sleep=lambda s: None).claim(other) is None
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert claim_path(tmp_path, DIGEST).exists()  # left behind
        assert sweep_claims(tmp_path) == 1  # the dead holder's; the live one's stays
        assert not claim_path(tmp_path, DIGEST).exists() and claim_path(tmp_path, other).exists()
        claim = FetchClaims(tmp_path, longest_wait_s=0, sleep=lambda s: None).claim(DIGEST)
        assert claim is not None and not claim.waited
        claim.release()
    finally:
        alive.communicate("")
    assert sweep_claims(tmp_path) == 0  # a holder that releases removes its file
    assert not claim_path(tmp_path, other).exists()


class Store:
    def __init__(self, count: int, size: int = 4096):
        self.chunks = {}
        for i in range(count):
            data = blake3.blake3(bytes([i % 256, i // 256])).digest(length=size)
            self.chunks[blake3.blake3(data).hexdigest()] = data
        self.fetched: list[str] = []

    def fetch(self, digest, into=None, landed=None):
        self.fetched.append(digest)
        return self.chunks.get(digest)


#: another engine's tier on the same directory: it takes the chunk of the data given as hex as the
#: connector does (arrive_all, its digest checked later by admit), telling the test when its fetch
#: began and waiting for a line before it returns the bytes (or, with "fail", nothing: the store
#: lacks it), then closes
PEER = """
import sys
from pathlib import Path

import blake3
from kvcdn_vllm.tier import ChunkTier

data = bytes.fromhex(sys.argv[2])
digest = blake3.blake3(data).hexdigest()

def fetch(asked, into, landed=None):
    print("fetching", flush=True)
    return data if sys.stdin.readline().strip() == "go" else None

peer = ChunkTier(fetch, 1 << 20, 1 << 20, Path(sys.argv[1]), print)
arrival = peer.arrive_all([(digest, len(data))])[0]  # as the connector takes a step's chunks
try:
    arrival.wait_settled()
    peer.admit(digest, len(data))
    print("got", flush=True)
except Exception as exc:
    print("failed", str(exc).splitlines()[0], flush=True)
peer.close()
"""


@pytest.mark.parametrize("answer", ["go", "fail"])
def test_a_tier_waits_for_another_process_fetching_the_chunk_and_reads_its_file(tmp_path, answer):
    """The peer's fetch holds the claim; this tier's get waits (its first pause is seen), then reads
    the peer's file, checked once, and fetches nothing; when the peer's fetch fails, it fetches
    the chunk itself."""
    store = Store(1)
    ((digest, data),) = store.chunks.items()
    folder = tmp_path / "tier"
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(folder), data.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert peer.stdout is not None and peer.stdin is not None
    assert peer.stdout.readline().strip() == "fetching"  # the peer holds the claim
    waiting = threading.Event()

    def pause(seconds):
        waiting.set()
        threading.Event().wait(seconds)

    claims = FetchClaims(folder, longest_wait_s=600, sleep=pause)  # a bound a loaded machine never reaches
    t = ChunkTier(store.fetch, 0, 1 << 20, folder, print, DiskWriter(print), claims=claims)
    got = []
    reader = threading.Thread(target=lambda: got.append(t.get(digest, len(data))))
    reader.start()
    assert waiting.wait(60)
    peer.stdin.write(f"{answer}\n")
    peer.stdin.flush()
    reader.join(60)
    said = peer.communicate()[0]
    t.close()
    if answer == "go":
        assert "got" in said
        assert got == [(data, DISK)] and store.fetched == [] and t.fetches_shared == 1
    else:
        assert "failed" in said
        assert got == [(data, REMOTE)] and store.fetched == [digest] and t.fetches_shared == 0
    assert (folder / digest[:2] / digest).read_bytes() == data
    assert not claim_path(folder, digest).exists()


#: one of two engines getting the same chunks at once, every chunk on a thread of its own: waits
#: for "go", checks every byte, and reports where each chunk came from. Its store answers a fetch
#: once the other engine marked the claim (a store slower than the other engine's arrival, as a
#: remote one is beside workers that start a step together), so each chunk has one holder and one
#: waiter whatever the threads' timing.
RACER = """
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
from kvcdn_vllm.claims import FetchClaims, claim_path
from kvcdn_vllm.tier import ChunkTier

directory, log, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
chunks = {}
for i in range(count):
    data = blake3.blake3(bytes([i % 256, i // 256])).digest(length=65536)
    chunks[blake3.blake3(data).hexdigest()] = data

def fetch(digest, into):
    deadline = time.monotonic() + 120
    while os.path.getsize(claim_path(directory, digest)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    with open(log, "a") as f:
        f.write(digest + "\\n")
    return chunks[digest]

tier = ChunkTier(fetch, 0, 1 << 30, directory, print, claims=FetchClaims(directory, longest_wait_s=600))
sys.stdin.readline()
with ThreadPoolExecutor(count) as pool:
    got = list(pool.map(lambda d: (d, tier.get(d, 65536)), chunks))
tier.close()
assert all(bytes(data) == chunks[d] for d, (data, _) in got)
print(json.dumps({"where": sorted(w for _, (_, w) in got), "shared": tier.fetches_shared}))
"""


def test_two_processes_getting_the_same_chunks_at_once_fetch_each_once(tmp_path):
    count = 16
    folder, log = tmp_path / "tier", tmp_path / "fetched.log"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(folder), str(log), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for racer in racers:
        assert racer.stdin is not None
        racer.stdin.write("go\n")
        racer.stdin.flush()
    said = [racer.communicate(timeout=600)[0] for racer in racers]
    assert [r.returncode for r in racers] == [0, 0], said
    fetched = log.read_text().split()
    assert len(fetched) == len(set(fetched)) == count  # each chunk from the store once
    reports = [json.loads(s.strip().splitlines()[-1]) for s in said]
    wheres = [r["where"] for r in reports]
    assert sum(w.count(REMOTE) for w in wheres) == count  # each fetched by its claim's holder
    assert sum(w.count(DISK) for w in wheres) == sum(r["shared"] for r in reports) == count  # read after waiting
    assert not list(folder.glob("*/.*.claim"))
    assert sorted(p.name for p in folder.glob("*/*") if not p.name.startswith(".")) == sorted(set(fetched))
    assert all(os.path.getsize(p) == 65536 for p in folder.glob("*/*"))


class Holder:
    """A claim another process holds (this process's own, on another open file: ``flock`` excludes it)."""

    def __init__(self, folder: Path, digest: str):
        self.claim = FetchClaims(folder).claim(digest)
        assert self.claim is not None


def test_after_waiting_for_a_fetch_that_left_no_file_a_tier_fetches_unclaimed(tmp_path):
    """Waiters do not queue behind each other's fetches: the one that finds no file after its wait
    fetches without holding the claim."""
    store = Store(1)
    ((digest, data),) = store.chunks.items()
    folder = tmp_path / "tier"
    holder = Holder(folder, digest)
    free_during_fetch = []

    def fetch(asked, into):
        taken = FetchClaims(folder, longest_wait_s=0, sleep=lambda s: None).claim(asked)
        free_during_fetch.append(taken is not None)
        if taken is not None:
            taken.release()
        return store.fetch(asked)

    claims = FetchClaims(folder, sleep=lambda s: holder.claim.release())  # its fetch left no file
    t = ChunkTier(fetch, 0, 1 << 20, folder, print, DiskWriter(print), claims=claims)
    assert t.get(digest, len(data)) == (data, REMOTE)
    assert free_during_fetch == [True] and t.fetches_shared == 0
    t.close()


class Counted(FetchClaims):
    def __init__(self, folder):
        super().__init__(folder)
        self.asked: list[str] = []

    def claim(self, digest):
        self.asked.append(digest)
        return super().claim(digest)


def test_a_chunk_over_the_disk_budget_is_not_claimed_and_a_tier_start_sweeps_left_claims(tmp_path):
    store = Store(2)
    small = next(iter(store.chunks))
    big = blake3.blake3(b"x" * 8192).hexdigest()
    store.chunks[big] = b"x" * 8192
    folder = tmp_path / "tier"
    leftover = claim_path(folder, small)
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"w")  # a killed holder's
    claims = Counted(folder)
    t = ChunkTier(store.fetch, 0, 5000, folder, print, DiskWriter(print), claims=claims)
    assert not leftover.exists()  # swept at start
    assert t.get(big, 8192)[1] == REMOTE and t.get(small, 4096)[1] == REMOTE
    assert claims.asked == [small]  # the big one never has a file here: nobody would wait for it
    t.close()
