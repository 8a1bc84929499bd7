"""The storage-backend contract suite: what :mod:`kvcdn_core.contracts.storage` promises, checked."""

from __future__ import annotations

import hashlib
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from kvcdn_core.contracts.storage import ObjectInfo, ObjectNotFound, StorageBackend
from kvcdn_core.errors import KvcdnError

#: Big enough that a streaming read takes several chunks.
STREAM_BYTES = 3 * (1 << 20) + 17


def _payload(tag: str, size: int) -> bytes:
    """Deterministic bytes that differ per tag, so a mixed-up object is caught."""
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def assert_storage_contract(backend_factory: Callable[[], StorageBackend], threads: int = 8) -> None:
    """Check a storage backend against the storage contract.

    ``backend_factory()`` returns a backend over an empty store; it is called once per check. The
    checks: round trip of files and bytes, listing by prefix (string prefix, sorted by key, sizes),
    missing keys, overwrite, rename, streaming ``open_read``, invalid keys, and concurrent use of one
    instance from ``threads`` threads with every byte checked afterwards.
    """
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for check in (
            _round_trip,
            _listing,
            _missing_keys,
            _overwrite,
            _rename,
            _streaming,
            _invalid_keys,
            _concurrent,
        ):
            store = backend_factory()
            assert isinstance(store, StorageBackend), f"{type(store).__name__} is not a StorageBackend"
            check(store, work / check.__name__, threads)


def _round_trip(store: StorageBackend, work: Path, threads: int) -> None:
    work.mkdir()
    source = work / "source.kv"
    source.write_bytes(_payload("round", 70_000))
    store.put_file("a/b/c.kv", source)
    assert store.exists("a/b/c.kv"), "put_file then exists is False"
    assert store.size_of("a/b/c.kv") == 70_000, "size_of differs from the bytes put"
    target = work / "out" / "c.kv"
    target.parent.mkdir()
    store.get_file("a/b/c.kv", target)
    assert target.read_bytes() == source.read_bytes(), "get_file returned other bytes"
    assert store.read_bytes("a/b/c.kv") == source.read_bytes(), "read_bytes returned other bytes"
    store.write_bytes("small.json", b'{"x": 1}')
    assert store.read_bytes("small.json") == b'{"x": 1}', "write_bytes then read_bytes differs"
    store.delete("a/b/c.kv")
    assert not store.exists("a/b/c.kv"), "delete left the object"
    assert store.read_bytes("a/b/c.kv") is None, "read_bytes of a deleted object is not None"


def _listing(store: StorageBackend, work: Path, threads: int) -> None:
    keys = ["b/2.kv", "a-c.kv", "a/b.kv", "a/bc/d.kv", "a/b.kv.json", "ab.kv", "z.kv"]
    for i, key in enumerate(keys):
        store.write_bytes(key, _payload(key, 10 + i))
    everything = store.list("")
    assert all(isinstance(info, ObjectInfo) for info in everything), "list must return ObjectInfo items"
    assert [i.key for i in everything] == sorted(keys), f"list('') is not every key sorted: {everything}"
    assert {i.key: i.size for i in everything} == {k: 10 + n for n, k in enumerate(keys)}, "list sizes are wrong"
    assert [i.key for i in store.list("a/b")] == ["a/b.kv", "a/b.kv.json", "a/bc/d.kv"], (
        "prefix 'a/b' is a string prefix"
    )
    assert [i.key for i in store.list("a/")] == ["a/b.kv", "a/b.kv.json", "a/bc/d.kv"]
    assert [i.key for i in store.list("a")] == ["a-c.kv", "a/b.kv", "a/b.kv.json", "a/bc/d.kv", "ab.kv"]
    assert [i.key for i in store.list("b/2.kv")] == ["b/2.kv"], "a full key lists itself"
    assert store.list("nothing/") == [] and store.list("q") == [], "an unmatched prefix lists nothing"


def _missing_keys(store: StorageBackend, work: Path, threads: int) -> None:
    work.mkdir()
    assert store.exists("missing.kv") is False
    assert store.size_of("missing.kv") is None
    assert store.read_bytes("missing.kv") is None
    store.delete("missing.kv")  # nothing happens
    for what, call in (
        ("get_file", lambda: store.get_file("missing.kv", work / "x")),
        ("open_read", lambda: store.open_read("missing.kv")),
        ("rename", lambda: store.rename("missing.kv", "other.kv")),
    ):
        try:
            call()
        except ObjectNotFound:
            continue
        except Exception as exc:  # noqa: BLE001 - the contract names the one exception
            raise AssertionError(f"{what} of a missing key raised {type(exc).__name__}, not ObjectNotFound") from exc
        raise AssertionError(f"{what} of a missing key must raise ObjectNotFound")
    assert not (work / "x").exists(), "a failed get_file left a file behind"
    assert not store.exists("other.kv"), "a failed rename created its target"


def _overwrite(store: StorageBackend, work: Path, threads: int) -> None:
    work.mkdir()
    first, second = work / "1", work / "2"
    first.write_bytes(_payload("first", 5000))
    second.write_bytes(_payload("second", 300))
    store.put_file("o.kv", first)
    store.put_file("o.kv", second)
    assert store.read_bytes("o.kv") == second.read_bytes(), "put_file did not replace the object whole"
    assert store.size_of("o.kv") == 300
    store.write_bytes("o.kv", b"third")
    assert store.read_bytes("o.kv") == b"third", "write_bytes did not replace the object"
    assert [i.key for i in store.list("o")] == ["o.kv"], "an overwrite left another object behind"


def _rename(store: StorageBackend, work: Path, threads: int) -> None:
    store.write_bytes("staging/x.kv", b"payload")
    store.rename("staging/x.kv", "final/x.kv")
    assert not store.exists("staging/x.kv"), "rename left the source"
    assert store.read_bytes("final/x.kv") == b"payload", "rename lost the bytes"
    store.write_bytes("staging/y.kv", b"newer")
    store.rename("staging/y.kv", "final/x.kv")
    assert store.read_bytes("final/x.kv") == b"newer", "rename did not replace the target"
    assert [i.key for i in store.list("")] == ["final/x.kv"]


def _streaming(store: StorageBackend, work: Path, threads: int) -> None:
    data = _payload("stream", STREAM_BYTES)
    store.write_bytes("big.kv", data)
    stream = store.open_read("big.kv")
    try:
        chunks = []
        while block := stream.read(1 << 20):
            assert len(block) <= 1 << 20, "read(n) returned more than n bytes"
            chunks.append(block)
    finally:
        stream.close()
    assert len(chunks) >= 3, "open_read did not stream in chunks"
    assert b"".join(chunks) == data, "open_read returned other bytes"
    with store.open_read("big.kv") as again:
        assert again.read(5) == data[:5], "open_read is not usable as a context manager"


def _invalid_keys(store: StorageBackend, work: Path, threads: int) -> None:
    for key in ("", "/abs.kv", "a/../b.kv", "a//b.kv", "./a.kv", "a\\b.kv"):
        try:
            store.write_bytes(key, b"x")
        except KvcdnError:
            continue
        raise AssertionError(f"write_bytes accepted the invalid key {key!r}")
    try:
        store.list("../")
    except KvcdnError:
        pass
    else:
        raise AssertionError("list accepted the prefix '../'")


def _concurrent(store: StorageBackend, work: Path, threads: int) -> None:
    """One instance, many threads: distinct keys written, read, listed and renamed at once, then
    every byte checked; racing writers of one key leave one of the whole objects."""
    work.mkdir()
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def worker(n: int) -> None:
        try:
            barrier.wait()
            source = work / f"src{n}"
            source.write_bytes(_payload(f"t{n}", 40_000 + n))
            store.put_file(f"c/{n}.kv", source)
            store.write_bytes("shared.kv", _payload(f"shared{n}", 20_000))
            assert store.read_bytes(f"c/{n}.kv") == source.read_bytes()
            store.list("c/")
            store.rename(f"c/{n}.kv", f"d/{n}.kv")
            with store.open_read(f"d/{n}.kv") as fh:
                assert fh.read() == source.read_bytes()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the others
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in pool), "a storage call hung under concurrent use"
    assert not errors, f"concurrent use failed: {errors[0]!r}"
    assert [i.key for i in store.list("d/")] == sorted(f"d/{n}.kv" for n in range(threads))
    assert store.list("c/") == []
    for n in range(threads):
        assert store.read_bytes(f"d/{n}.kv") == _payload(f"t{n}", 40_000 + n), f"object {n} was mixed up"
    shared = store.read_bytes("shared.kv")
    assert shared in {_payload(f"shared{n}", 20_000) for n in range(threads)}, "racing writers mixed their bytes"
