"""What a chunk store's lookup pays to notice other writers, on a local directory and on S3 (moto).

Every lookup of :func:`kvcdn_core.store.index.load` checks whether the index changed since it was
cached. With the change mark (``index/changed``) that is one small read while nothing changed; a
store written by a kvcdn before the mark has none, and each lookup lists the index's two folders
instead: up to 256 operation objects between compactions, two of S3's requests.

The store holds ``--artifacts`` in one base and ``--ops`` more as operation objects (the most
before a compaction: 256), 2,048 tokens each; each lookup is a prompt sharing one of them whole.
Both ways run in one process, one after the other, on the same store (the mark is deleted for the
second). The last ``--adds`` of the operations are written by another view of the store while the
reader's index is warm, each followed by a lookup of what it added: the reader reads that one
operation and adds it to its recent layer (:class:`kvcdn_core.store.index.Loaded`). Then one
lookup of a new reader (the listing, the base and every operation read); ``--removes`` artifacts of
the base removed by the other view, each followed by the warm reader's lookup of the removed
artifact's own prompt (the reader hides it in its main layer and walks past it); and one lookup of
the warm reader after the other view compacted the index and added one more artifact (the new
base taken as stored, the add in the recent layer). Wall times, one thread.

Moto on loopback answers in about 3 ms, most of it the client's and the server's CPU on the same
cores. A third row puts ``--round-trip-ms`` before every request of the readers (not the writer)
to a local directory: a store across a network, where a new reader's operations are read several at
a time (:data:`kvcdn_core.store.index.READERS`).

    OMP_NUM_THREADS=1 python benchmarks/index_refresh.py [--artifacts 1000] [--ops 256] [--lookups 200] [--adds 20]
        [--removes 10] [--round-trip-ms 20]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS = 2048
FINGERPRINT = {"architecture": "LlamaForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}


def Entry(name: str, root: str) -> SimpleNamespace:  # noqa: N802 - reads as the record it stands for
    """What the index reads of a chunk store's record."""
    return SimpleNamespace(
        name=name,
        root=root,
        token_count=TOKENS,
        chunk_tokens=256,
        reuse="any_prefix",
        model=dict(FINGERPRINT),
        compute_dtype="float32",
        quantization=None,
    )


class RoundTrips:
    """A backend whose every request waits ``seconds`` first, as one across a network does."""

    def __init__(self, backend, seconds: float) -> None:
        self.backend, self.seconds = backend, seconds

    def __getattr__(self, name: str):
        real = getattr(self.backend, name)

        def delayed(*args, **kwargs):
            time.sleep(self.seconds)
            return real(*args, **kwargs)

        return delayed


class Listings:
    """A backend's listings, counted."""

    def __init__(self, backend) -> None:
        self.count = 0
        real = backend.list

        def counted(prefix: str = ""):
            self.count += 1
            return real(prefix)

        backend.list = counted


def documents(count: int, seed: int) -> Any:
    """``count`` documents' token ids, one row each: an array, not Python lists (21 million ints in
    lists would make each of the collector's full passes cost more than what is timed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, 49_152, size=(count, TOKENS))


def fill(backend, root: str, artifacts: int, ops: int) -> Any:
    from kvcdn_core.store import index

    docs = documents(artifacts + ops, 0)
    index.rebuild(backend, [(Entry(f"d{i:05d}", root), ids) for i, ids in enumerate(docs[:artifacts])])
    for i, ids in enumerate(docs[artifacts:], artifacts):
        index.add(backend, Entry(f"d{i:05d}", root), ids)
    return docs


def timed(reader, root: str, docs, lookups: int) -> tuple[float, float]:
    """Median lookup in ms, and listings per lookup."""
    from kvcdn_core.store import index

    listings = Listings(reader)
    index.load(reader)  # warm, as an engine's scheduler is
    listings.count = 0
    times = []
    for i in range(lookups):
        ids = docs[(i * 7919) % len(docs)].tolist()
        began = time.perf_counter()
        hits = index.lookup(reader, root, ids + [1, 2, 3], limit=1)
        times.append((time.perf_counter() - began) * 1000)
        assert hits and hits[0].prefix_tokens == TOKENS
    return statistics.median(times), listings.count / lookups


def after_adds(reader, writer, root: str, adds: int) -> float:
    """Median ms of a lookup right after another writer's put (one more operation object)."""
    from kvcdn_core.store import index

    more = documents(adds, 1)
    times = []
    for i, row in enumerate(more):
        ids = row.tolist()
        index.add(writer, Entry(f"new{i:04d}", root), ids)
        began = time.perf_counter()
        hits = index.lookup(reader, root, ids + [1], limit=1)
        times.append((time.perf_counter() - began) * 1000)
        assert hits and hits[0].name == f"new{i:04d}"
    return statistics.median(times)


def after_removes(reader, writer, root: str, docs, artifacts: int, removes: int) -> float:
    """Median ms of a lookup of a removed artifact's prompt right after another writer removed it."""
    from kvcdn_core.store import index

    times = []
    for i in range(0, artifacts, max(1, artifacts // removes))[:removes]:  # of the base
        name, ids = f"d{i:05d}", docs[i].tolist()
        assert index.remove(writer, Entry(name, root)) == 1
        began = time.perf_counter()
        hits = index.lookup(reader, root, ids + [1], limit=1)
        times.append((time.perf_counter() - began) * 1000)
        assert name not in {h.name for h in hits}
    return statistics.median(times)


def first_lookup(open_backend, root: str, ids: list[int]) -> float:
    """Seconds of a new reader's first lookup: the listing, the base and every operation read."""
    from kvcdn_core.store import index

    began = time.perf_counter()
    assert index.lookup(open_backend(), root, ids + [1], limit=1)
    return time.perf_counter() - began


def after_compaction(reader, writer, root: str, ids: list[int]) -> float:
    """Seconds of a warm reader's lookup after another writer compacted and added one more."""
    from kvcdn_core.store import index

    index.compact(writer)
    index.add(writer, Entry("after", root), documents(1, 2)[0])
    began = time.perf_counter()
    assert index.lookup(reader, root, ids + [1], limit=1)
    return time.perf_counter() - began


def run(label: str, open_backend, args, open_writer=None) -> str:
    """One row: ``open_backend`` opens each reader's view of the store, ``open_writer`` the other
    view's (the same by default)."""
    from kvcdn_core.store import index, keys

    root = keys.root_key(FINGERPRINT, keys.representation("float32", None))
    writer = (open_writer or open_backend)()
    docs = fill(writer, root, args.artifacts, args.ops - args.adds)
    reader = open_backend()
    index.load(reader)
    changed = after_adds(reader, writer, root, args.adds)
    pending = len(writer.list(index.OPS))
    marked = timed(reader, root, docs, args.lookups)
    cold = first_lookup(open_backend, root, docs[0].tolist())
    mark = writer.read_bytes(index.MARK)
    writer.delete(index.MARK)  # as a store written before the mark
    unmarked = timed(open_backend(), root, docs, args.lookups)
    writer.write_bytes(index.MARK, mark)
    removed = after_removes(reader, writer, root, docs, args.artifacts, args.removes)
    compacted = after_compaction(reader, writer, root, docs[1].tolist())
    return (
        f"| {label} | {args.artifacts:,} + {pending} | {marked[0]:.2f} ms ({marked[1]:g}) "
        f"| {unmarked[0]:.2f} ms ({unmarked[1]:g}) | {unmarked[0] / marked[0]:.1f}x | {changed:.2f} ms "
        f"| {removed:.2f} ms | {compacted * 1000:.0f} ms | {cold * 1000:.0f} ms |"
    )


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a count of at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=int, default=1000, help="artifacts in the base")
    parser.add_argument("--ops", type=int, default=256, help="artifacts added after it, one operation each")
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--adds", type=int, default=20, help="of the operations: each followed by a timed lookup")
    parser.add_argument(
        "--removes", type=positive, default=10, help="artifacts of the base removed, each then looked up"
    )
    parser.add_argument("--round-trip-ms", type=float, default=20, help="the third row's wait per request (0: no row)")
    args = parser.parse_args(argv)

    from kvcdn_core import open_storage
    from kvcdn_core.builtin.local_storage import LocalStorage
    from tests.support import services

    print(
        "| store | artifacts: base + operations | lookup p50 (listings each), mark | without the mark | ratio "
        "| after another writer's add, p50 | after its remove, p50 | after its compaction | a new reader's first |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kvcdn-index-refresh-") as tmp:
        print(run("local directory", lambda: LocalStorage(Path(tmp) / "store"), args), flush=True)
    if args.round_trip_ms > 0:
        with tempfile.TemporaryDirectory(prefix="kvcdn-index-refresh-") as tmp:
            where, wait = Path(tmp) / "store", args.round_trip_ms / 1000

            def far() -> RoundTrips:
                return RoundTrips(LocalStorage(where), wait)

            label = f"local directory, {args.round_trip_ms:g} ms a request"
            print(run(label, far, args, open_writer=lambda: LocalStorage(where)), flush=True)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    with services.moto_s3("kvcdn-bench") as s3:
        os.environ.update(s3.env)
        print(run("S3 (moto, loopback)", lambda: open_storage("s3://kvcdn-bench/store"), args), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
