"""GC and crashes: a put killed mid-way leaves nothing a record needs missing and its orphans are
reclaimed once its marker expires; GC never takes a chunk a record or a put in progress uses, also
when puts, deletes and GCs that share chunks run at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.store.chunkstore import PENDING_TTL, ChunkStore, chunk_key
from tests.support.storefiles import churn, write_kinds

NOW = 1_000_000.0


@pytest.fixture
def family(tmp_path):
    """A 700-token artifact and four that continue its first 520 tokens (2 shared full chunks)."""
    base = tmp_path / "base.kv"
    tensors = write_kinds(base, ["full_attention"], 700, seed=1)
    paths = {"base": base}
    for i in range(4):
        path = tmp_path / f"turn{i}.kv"
        shared = {k: (v[..., :520, :] if v.dim() >= 2 else v[:520]) for k, v in tensors.items()}
        write_kinds(path, ["full_attention"], 600 + 50 * i, seed=10 + i, prefix_of=shared)
        paths[f"turn{i}"] = path
    return paths


def exact(store, name, source, tmp_path):
    out = tmp_path / f"got-{name}-{threading.get_ident()}.kv"
    store.get(name, out)
    same = out.read_bytes() == source.read_bytes()
    out.unlink()
    return same


def test_gc_reclaims_what_no_record_references(tmp_path, family):
    store = ChunkStore(LocalStorage(tmp_path / "store"), clock=lambda: NOW)
    for name in ("base", "turn0"):
        store.put(family[name], name)
    before = {o.key for o in store.backend.list("chunks/")}
    assert store.gc().chunks_deleted == 0
    store.delete("base")
    report = store.gc()
    # base's last chunk (tokens 512-700) and its tail go; the two shared chunks stay for turn0
    assert report.chunks_deleted == 2 and report.records == 1
    after = {o.key for o in store.backend.list("chunks/")}
    assert after == {chunk_key(d) for d in store.record("turn0").digests}
    assert len(before - after) == 2
    assert exact(store, "turn0", family["turn0"], tmp_path)
    assert store.check().ok and store.check().orphans == 0


def test_a_pending_marker_protects_its_chunks_until_it_expires(tmp_path, family):
    clock = [NOW]
    store = ChunkStore(LocalStorage(tmp_path / "store"), clock=lambda: clock[0])
    store.put(family["base"], "base")
    digests = store.record("base").digests
    store.delete("base")
    # a put in progress (its marker written, its record not yet) will reference base's chunks
    store.backend.write_bytes(
        "pending/p1.json", f'{{"created": {NOW}, "name": "x", "digests": {digests!r}}}'.replace("'", '"').encode()
    )
    clock[0] = NOW + PENDING_TTL - 1
    assert store.gc().chunks_deleted == 0
    assert store.check().orphans == 0 and store.check().pending == 1
    clock[0] = NOW + PENDING_TTL
    report = store.gc()
    assert (report.chunks_deleted, report.pending_expired) == (len(set(digests)), 1)
    # Nothing is left but the prefix index's own write-once log (it records the add and the delete).
    assert [o.key for o in store.backend.list("") if not o.key.startswith("index/")] == []


class Hooked(LocalStorage):
    """LocalStorage that calls ``on_rename(key)`` once, before a move."""

    on_rename = None

    def rename(self, source_key, target_key):
        if self.on_rename:
            hook, self.on_rename = self.on_rename, None
            hook(source_key)
        return super().rename(source_key, target_key)


def test_gc_gives_back_a_chunk_a_put_found_present_meanwhile(tmp_path, family):
    """GC lists no reference to base's chunks (base was deleted), then, before it moves the first
    one to its trash, a put of turn0 finds the shared chunks present and writes its record. GC's
    second look sees the record and moves them back: turn0 stays whole."""
    backend = Hooked(tmp_path / "store")
    store = ChunkStore(backend)
    store.put(family["base"], "base")
    store.delete("base")
    backend.on_rename = lambda _key: ChunkStore(backend).put(family["turn0"], "turn0")
    report = store.gc()
    assert report.restored >= 1
    assert exact(store, "turn0", family["turn0"], tmp_path)
    assert store.check().ok


def test_a_put_uploads_again_a_chunk_a_gc_took_after_it_looked(tmp_path, family):
    """The put's marker is invisible to GC (as if GC's listings ran before it was written): the put
    finds a shared chunk present, GC takes it, and the put's final check puts it back."""
    backend = Hooked(tmp_path / "store")
    store = ChunkStore(backend)
    store.put(family["base"], "base")
    store.delete("base")

    calls = []

    def exists_then_gc(key):
        found = LocalStorage.exists(backend, key)
        if key.startswith("chunks/") and not calls:
            calls.append(key)
            blind = ChunkStore(backend, pending_ttl=-1)  # a GC that sees no live marker
            assert blind.gc().chunks_deleted > 0
        return found

    backend.exists = exists_then_gc
    report = store.put(family["turn0"], "turn0")
    assert calls and report.chunks_shared >= 1
    assert exact(store, "turn0", family["turn0"], tmp_path)
    assert store.check().ok


KILLED_PUT = """
import os, sys, threading
from kvcdn_core.builtin import local_storage
write = local_storage.LocalStorage.write_bytes
def write_bytes(self, key, data):
    write(self, key, data)
    if key.startswith("chunks/"):
        open(os.environ["READY"], "w").close()
        threading.Event().wait()  # stopped here until killed
local_storage.LocalStorage.write_bytes = write_bytes
from kvcdn_core.cli.app import main
main(sys.argv[1:])
"""


def test_kill_9_during_a_put_then_gc(tmp_path, family):
    store_dir = tmp_path / "store"
    store = ChunkStore(LocalStorage(store_dir))
    store.put(family["turn1"], "turn1")
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_PUT, "store", "put", str(family["base"]), "--store", str(store_dir)],
        env={**os.environ, "READY": str(ready)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert store.names() == ["turn1"]  # the killed put wrote no record
    assert len(store.backend.list("pending/")) == 1
    check = store.check()
    assert check.ok and check.pending == 1 and check.orphans == 0  # its chunks are still protected
    assert store.gc().chunks_deleted == 0  # within the marker's life: a slow put, not a dead one
    report = store.gc(now=time.time() + PENDING_TTL)
    assert report.pending_expired == 1 and report.chunks_deleted >= 1
    after = store.check()
    assert after.ok and after.orphans == 0 and after.pending == 0
    assert {o.key for o in store.backend.list("chunks/")} == {chunk_key(d) for d in store.record("turn1").digests}
    assert exact(store, "turn1", family["turn1"], tmp_path)
    # and the put, run again, completes
    assert store.put(family["base"], "base").name == "base"
    assert exact(store, "base", family["base"], tmp_path)


def test_concurrent_puts_deletes_and_gcs_that_share_chunks(tmp_path, family):
    backend = LocalStorage(tmp_path / "store")
    names = sorted(family)
    errors = churn(backend, {n: family[n] for n in names}, {"turn0", "turn2"})
    assert not errors, errors
    store = ChunkStore(backend)
    remaining = store.names()
    assert sorted(remaining) == sorted(set(names) - {"turn0", "turn2"})
    for name in remaining:
        assert exact(store, name, family[name], tmp_path), name
    check = store.check()
    assert check.ok, check.problems
    store.gc()
    assert store.check().orphans == 0
    for name in remaining:
        assert exact(store, name, family[name], tmp_path), name


def test_gc_refuses_to_run_past_an_unreadable_record(tmp_path, family, cli):
    """A record GC cannot read may reference any chunk: GC deletes nothing and says which record."""
    store = ChunkStore(LocalStorage(tmp_path / "store"))
    store.put(family["base"], "base")
    store.put(family["turn0"], "turn0")
    store.backend.write_bytes("artifacts/turn0.json", b'{"format": "kvcdn-chunked", "version": 1')
    store.delete("base")
    before = store.backend.list("chunks/")
    result = cli("store", "gc", "--store", tmp_path / "store")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "gc refused: record 'turn0'" in result.stderr
    assert store.backend.list("chunks/") == before
    listed = cli("store", "ls", "--store", tmp_path / "store")
    assert listed.exit_code == 0 and "warning: record 'turn0'" in listed.stderr
    checked = cli("store", "check", "--store", tmp_path / "store")
    assert checked.exit_code == 1 and "record 'turn0': corrupted" in checked.stdout


def test_a_store_needs_a_backend_that_keeps_bytes():
    from kvcdn_core.errors import KvcdnError

    class KvOnly(LocalStorage):
        stores = "kv"

    with pytest.raises(KvcdnError, match="keeps only .kv artifacts"):
        ChunkStore(KvOnly("/nonexistent"))


def test_gc_on_a_backend_without_rename(tmp_path, family):
    class NoRename(LocalStorage):
        """Like the hosted backend: declares rename unsupported, and refuses it."""

        unsupported = frozenset({"rename"})

        def rename(self, source_key, target_key):
            self.require("rename")

    store = ChunkStore(NoRename(tmp_path / "store"))
    store.put(family["base"], "base")
    store.put(family["turn0"], "turn0")
    store.delete("base")
    assert store.gc().chunks_deleted == 2
    assert store.check().ok and store.check().orphans == 0
    assert exact(store, "turn0", family["turn0"], tmp_path)
