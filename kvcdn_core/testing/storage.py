"""The storage-backend contract suite: what :mod:`kvcdn_core.contracts.storage` promises, checked."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvcdn_core.contracts.storage import (
    CAPABILITIES,
    OPTIONAL_OPERATIONS,
    STORES,
    NotSupported,
    ObjectInfo,
    ObjectNotFound,
    StorageBackend,
)
from kvcdn_core.errors import KvcdnError

#: Big enough that a streaming read takes several chunks.
STREAM_BYTES = 3 * (1 << 20) + 17


def _payload(store: StorageBackend, tag: str, size: int) -> bytes:
    """Deterministic bytes that differ per tag, so a mixed-up object is caught: ``size`` raw bytes,
    or for a backend that stores only ``.kv`` artifacts a valid artifact of about that size."""
    if type(store).stores == "kv":
        return _kv_payload(tag, size)
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


@functools.lru_cache(maxsize=64)
def _kv_payload(tag: str, size: int) -> bytes:
    """A valid ``.kv`` (one full-attention layer) of at least ``size`` bytes, its values drawn from ``tag``."""
    import torch

    from kvcdn_core import artifact

    tokens = max(1, (size - 1024) // 72)  # 8 bytes of token id + 2 x 8 float32 per token
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "big"))
    tensors = {
        "token_ids": torch.arange(tokens, dtype=torch.int64) % 1000,
        "layers.0.key": torch.randn(1, 1, tokens, 8, generator=generator),
        "layers.0.value": torch.randn(1, 1, tokens, 8, generator=generator),
    }
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00Z",
        "model": {"id": "kvcdn-testing/storage-contract", "architecture": "Qwen3ForCausalLM", "family": "qwen"},
        "compute_dtype": "float32",
        "layers": [
            {"index": 0, "kind": "full_attention", "tensors": {"key": "layers.0.key", "value": "layers.0.value"}}
        ],
        "quantization": None,
    }
    with tempfile.TemporaryDirectory() as tmp:
        return artifact.write_artifact(Path(tmp) / "payload.kv", manifest, tensors).read_bytes()


def assert_storage_contract(backend_factory: Callable[[], StorageBackend], threads: int = 8) -> None:
    """Check a storage backend against the storage contract.

    ``backend_factory()`` returns a backend over an empty store; it is called once per check. The
    checks: the declarations (``stores``, ``unsupported``, ``capabilities``) and their refusals, round trip
    of files and bytes, listing by prefix (string prefix, sorted by key, sizes), missing keys,
    overwrite, rename (or its declared refusal), streaming ``open_read``, invalid keys, and
    concurrent use of one instance from ``threads`` threads with every byte checked afterwards, and
    each declared capability really working: ``local_path`` files that hold the object's bytes (and
    become it when renamed onto), ``multipart`` uploads created, PUT part by part to their URLs over
    HTTP, completed, listed and aborted.
    A backend that stores only ``.kv`` artifacts is given valid artifacts (this needs torch).
    """
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for check in (
            _capabilities,
            _round_trip,
            _listing,
            _missing_keys,
            _overwrite,
            _rename,
            _streaming,
            _invalid_keys,
            _concurrent,
            _local_path,
            _multipart,
        ):
            store = backend_factory()
            assert isinstance(store, StorageBackend), f"{type(store).__name__} is not a StorageBackend"
            check(store, work / check.__name__, threads)


def _offers(store: StorageBackend, operation: str) -> bool:
    return operation not in type(store).unsupported


def _raises(expected: type[Exception], what: str, call: Callable[[], object]) -> None:
    """``call()`` must raise ``expected``, the one exception the contract names for the case."""
    try:
        call()
    except expected:
        return
    except Exception as exc:  # noqa: BLE001 - any other is the failure reported
        raise AssertionError(f"{what} raised {type(exc).__name__}, not {expected.__name__}") from exc
    raise AssertionError(f"{what} must raise {expected.__name__}")


def _refused(what: str, call: Callable[[], object]) -> None:
    _raises(NotSupported, what, call)


def _capabilities(store: StorageBackend, work: Path, threads: int) -> None:
    """What a backend declares is well formed, and what it declares it does not take is refused
    before anything changes."""
    cls = type(store)
    assert cls.stores in STORES, f"{cls.__name__}.stores is {cls.stores!r}, not one of {STORES}"
    unknown = set(cls.unsupported) - OPTIONAL_OPERATIONS
    assert not unknown, f"{cls.__name__}.unsupported names operations that are not optional: {sorted(unknown)}"
    unknown = set(cls.capabilities) - CAPABILITIES
    assert not unknown, f"{cls.__name__}.capabilities names unknown capabilities: {sorted(unknown)}"
    for capability in CAPABILITIES:
        assert cls.offers(capability) == (capability in cls.capabilities), f"{cls.__name__}.offers disagrees"
    work.mkdir()
    if cls.stores == "kv":
        raw = work / "raw.kv"
        raw.write_bytes(b"not a kv artifact" * 64)
        _refused("put_file of something that is not a .kv artifact", lambda: store.put_file("raw.kv", raw))
        _refused("write_bytes of something that is not a .kv artifact", lambda: store.write_bytes("raw.kv", b"x"))
        assert store.list("") == [], "a refused object was stored"
    if not _offers(store, "rename"):
        store.write_bytes("here.kv", _payload(store, "here", 100))
        _refused("rename, declared unsupported,", lambda: store.rename("here.kv", "there.kv"))
        assert [i.key for i in store.list("")] == ["here.kv"], "a refused rename changed the store"


def _round_trip(store: StorageBackend, work: Path, threads: int) -> None:
    work.mkdir()
    source = work / "source.kv"
    source.write_bytes(_payload(store, "round", 70_000))
    store.put_file("a/b/c.kv", source)
    assert store.exists("a/b/c.kv"), "put_file then exists is False"
    assert store.size_of("a/b/c.kv") == source.stat().st_size, "size_of differs from the bytes put"
    target = work / "out" / "c.kv"
    target.parent.mkdir()
    store.get_file("a/b/c.kv", target)
    assert target.read_bytes() == source.read_bytes(), "get_file returned other bytes"
    assert store.read_bytes("a/b/c.kv") == source.read_bytes(), "read_bytes returned other bytes"
    small = _payload(store, "small", 8)
    store.write_bytes("small.json", small)
    assert store.read_bytes("small.json") == small, "write_bytes then read_bytes differs"
    store.delete("a/b/c.kv")
    assert not store.exists("a/b/c.kv"), "delete left the object"
    assert store.read_bytes("a/b/c.kv") is None, "read_bytes of a deleted object is not None"


def _listing(store: StorageBackend, work: Path, threads: int) -> None:
    keys = ["b/2.kv", "a-c.kv", "a/b.kv", "a/bc/d.kv", "a/b.kv.json", "ab.kv", "z.kv"]
    sizes = {}
    for i, key in enumerate(keys):
        data = _payload(store, key, 10 + i)
        store.write_bytes(key, data)
        sizes[key] = len(data)
    everything = store.list("")
    assert all(isinstance(info, ObjectInfo) for info in everything), "list must return ObjectInfo items"
    assert [i.key for i in everything] == sorted(keys), f"list('') is not every key sorted: {everything}"
    assert {i.key: i.size for i in everything} == sizes, "list sizes are wrong"
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
    calls = [
        ("get_file", lambda: store.get_file("missing.kv", work / "x")),
        ("open_read", lambda: store.open_read("missing.kv")),
    ]
    if _offers(store, "rename"):
        calls.append(("rename", lambda: store.rename("missing.kv", "other.kv")))
    for what, call in calls:
        _raises(ObjectNotFound, f"{what} of a missing key", call)
    assert not (work / "x").exists(), "a failed get_file left a file behind"
    assert not store.exists("other.kv"), "a failed rename created its target"


def _overwrite(store: StorageBackend, work: Path, threads: int) -> None:
    work.mkdir()
    first, second = work / "1", work / "2"
    first.write_bytes(_payload(store, "first", 5000))
    second.write_bytes(_payload(store, "second", 300))
    store.put_file("o.kv", first)
    store.put_file("o.kv", second)
    assert store.read_bytes("o.kv") == second.read_bytes(), "put_file did not replace the object whole"
    assert store.size_of("o.kv") == second.stat().st_size
    third = _payload(store, "third", 5)
    store.write_bytes("o.kv", third)
    assert store.read_bytes("o.kv") == third, "write_bytes did not replace the object"
    assert [i.key for i in store.list("o")] == ["o.kv"], "an overwrite left another object behind"


def _rename(store: StorageBackend, work: Path, threads: int) -> None:
    if not _offers(store, "rename"):
        return  # its refusal is checked with the capabilities
    payload, newer = _payload(store, "payload", 7), _payload(store, "newer", 5)
    store.write_bytes("staging/x.kv", payload)
    store.rename("staging/x.kv", "final/x.kv")
    assert not store.exists("staging/x.kv"), "rename left the source"
    assert store.read_bytes("final/x.kv") == payload, "rename lost the bytes"
    store.write_bytes("staging/y.kv", newer)
    store.rename("staging/y.kv", "final/x.kv")
    assert store.read_bytes("final/x.kv") == newer, "rename did not replace the target"
    assert [i.key for i in store.list("")] == ["final/x.kv"]


def _streaming(store: StorageBackend, work: Path, threads: int) -> None:
    data = _payload(store, "stream", STREAM_BYTES)
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
    data = _payload(store, "invalid", 10)  # a valid object: only the key is wrong
    for key in ("", "/abs.kv", "a/../b.kv", "a//b.kv", "./a.kv", "a\\b.kv"):
        try:
            store.write_bytes(key, data)
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
    """One instance, many threads: distinct keys written, read, listed and renamed (or copied and
    deleted, where rename is not offered) at once, then every byte checked; racing writers of one
    key leave one of the whole objects."""
    work.mkdir()
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def worker(n: int) -> None:
        try:
            barrier.wait()
            source = work / f"src{n}"
            source.write_bytes(_payload(store, f"t{n}", 40_000 + n))
            store.put_file(f"c/{n}.kv", source)
            store.write_bytes("shared.kv", _payload(store, f"shared{n}", 20_000))
            assert store.read_bytes(f"c/{n}.kv") == source.read_bytes()
            store.list("c/")
            if _offers(store, "rename"):
                store.rename(f"c/{n}.kv", f"d/{n}.kv")
            else:
                store.put_file(f"d/{n}.kv", source)
                store.delete(f"c/{n}.kv")
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
        assert store.read_bytes(f"d/{n}.kv") == _payload(store, f"t{n}", 40_000 + n), f"object {n} was mixed up"
    shared = store.read_bytes("shared.kv")
    assert shared in {_payload(store, f"shared{n}", 20_000) for n in range(threads)}, "racing writers mixed their bytes"


def _declared(store: StorageBackend, capability: str, call: Callable[[], object]) -> object:
    """``call()`` of a capability's method: a backend that declares it must not refuse it."""
    try:
        return call()
    except NotSupported as exc:
        raise AssertionError(f"{type(store).__name__} declares {capability} but refuses it: {exc}") from exc


def _local_path(store: StorageBackend, work: Path, threads: int) -> None:
    """``local_path``: the object's file holds get()'s bytes, and a file renamed onto it becomes it."""
    if not type(store).offers("local_path"):
        return
    work.mkdir()
    data = _payload(store, "local", 5000)
    store.write_bytes("l/x.kv", data)
    path = Path(_declared(store, "local_path", lambda: store.path_of("l/x.kv")))  # type: ignore[arg-type]
    assert path.is_file() and path.read_bytes() == data, "path_of is not the file holding the object's bytes"
    store.get_file("l/x.kv", work / "got")
    assert (work / "got").read_bytes() == path.read_bytes(), "path_of's bytes differ from get_file's"
    newer = _payload(store, "local-newer", 300)
    staged = Path(_declared(store, "local_path", lambda: store.path_of("l/.staged")))  # type: ignore[arg-type]
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_bytes(newer)
    os.replace(staged, path)
    assert store.read_bytes("l/x.kv") == newer, "a file renamed onto path_of did not become the object"
    assert [i.key for i in store.list("l/")] == ["l/x.kv"], "path_of's files list as other objects"


def _put_part(url: str, data: bytes) -> str:
    # urllib would send a form Content-Type for a body; an object's bytes are octets
    headers = {"Content-Length": str(len(data)), "Content-Type": "application/octet-stream"}
    request = urllib.request.Request(url, data=data, method="PUT", headers=headers)
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310 - the backend's own URL
        etag = response.headers.get("ETag")
    assert etag, "a part's PUT answered no ETag"
    return etag


def _multipart(store: StorageBackend, work: Path, threads: int) -> None:
    """``multipart``: an upload in parts, PUT to the URLs the backend signed, assembles the object;
    an aborted one leaves nothing, and both show in ``list_multipart`` while in progress."""
    if not type(store).offers("multipart"):
        return
    data = _payload(store, "multipart", 70_000)
    assert isinstance(_declared(store, "multipart", lambda: store.needs_multipart(len(data))), bool), (
        "needs_multipart must answer a bool"
    )
    plan: dict = _declared(store, "multipart", lambda: store.start_multipart("m/x.kv", len(data), 600))  # type: ignore[assignment]
    upload_id, parts = plan["upload_id"], plan["parts"]
    assert sum(p["size"] for p in parts) == len(data), "the parts' sizes do not add up to the object"
    assert [p["part_number"] for p in parts] == list(range(1, len(parts) + 1)), "parts are not numbered 1..n"
    assert ("m/x.kv", upload_id) in store.list_multipart("m/"), "list_multipart misses an upload in progress"
    assert store.read_bytes("m/x.kv") is None, "an upload in progress is already an object"
    done, offset = [], 0
    for part in parts:
        done.append(
            {"part_number": part["part_number"], "etag": _put_part(part["url"], data[offset : offset + part["size"]])}
        )
        offset += part["size"]
    store.complete_multipart("m/x.kv", upload_id, done)
    assert store.read_bytes("m/x.kv") == data, "the completed multipart upload holds other bytes"
    assert ("m/x.kv", upload_id) not in store.list_multipart("m/"), "a completed upload is still listed"
    dropped = store.start_multipart("m/y.kv", len(data), 600)
    store.abort_multipart("m/y.kv", dropped["upload_id"])
    assert ("m/y.kv", dropped["upload_id"]) not in store.list_multipart("m/"), "an aborted upload is still listed"
    assert not store.exists("m/y.kv"), "an aborted upload left an object"
    store.abort_multipart("m/y.kv", dropped["upload_id"])  # gone already: nothing happens
