"""Every temp file the server makes is found by the collector (issue 26, item 7).

After a kill -9 during an S3 confirm, the local copy of the object (213 MB in the audit) survived
collection: the collector only looked for PUT temp files. Copies of S3 objects now live in
``tmp/.copy-<id>-<random>/`` and the collector sweeps the whole tmp dir, sparing what live work
holds: a copy this process is using, or one whose upload's confirm still renews its lease.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from kvcdn_core.testing.large_artifact import write_large_kv
from tests.hosted.conftest import S3_BUCKET
from tests.support import services
from tests.support.hosted import API, bearer, confirm, mint_key, put_bytes, request_upload, sha256_of

GRACE = 3600.0


@pytest.fixture
def s3_app(moto_s3, monkeypatch, tmp_path):
    """The app in-process on S3 (moto) and SQLite: ``(store, upload)``; ``upload(path)`` sends a
    file's bytes and returns its artifact id, not yet confirmed."""
    from fastapi.testclient import TestClient

    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    env = {**moto_s3.env, "KVCDN_API_KEY_ORGS": "acme", "KVCDN_ORPHAN_GRACE": str(GRACE)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = load_config(storage=f"s3://{S3_BUCKET}/temp-{tmp_path.name}", database_url=f"sqlite:///{tmp_path / 'db'}")
    app = create_app(config)
    client = TestClient(app)
    key = derive_key(config.api_key_seed, "acme")

    def upload(path: Path) -> str:
        body = {"name": path.name, "size_bytes": path.stat().st_size, "sha256": sha256_of(path)}
        plan = client.post(f"{API}/artifacts/upload-url", headers=bearer(key), json=body).json()
        assert put_bytes(plan, path.read_bytes()) is None
        return plan["artifact_id"]

    def confirm_upload(artifact_id: str) -> httpx.Response:
        return client.post(f"{API}/artifacts/{artifact_id}/confirm-upload", headers=bearer(key))

    return app.state.services.store, upload, confirm_upload


def _age(path: Path, seconds: float) -> None:
    """Make ``path`` and what it holds look ``seconds`` old."""
    moment = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (moment, moment))


def _status(store, artifact_id: str) -> str:
    return store.row(artifact_id).status


def test_a_crashed_confirms_copy_goes_once_its_lease_and_the_grace_have_passed(s3_app, small_kv):
    """The copy a confirm killed mid-download leaves (``.copy-<id>-*/.object.kv.*.tmp``): kept while
    its upload's lease runs (another replica might be confirming it) and while it is younger than the
    grace; removed after both, by a collector whose clock is moved, not waited for."""
    from kvcdn_server.db import artifacts

    store, upload, _ = s3_app
    artifact_id = upload(small_kv)
    start = time.time()
    with store.db.begin() as c:  # what a confirm's first step does, on a server that then dies
        c.execute(
            artifacts.update()
            .where(artifacts.c.id == artifact_id)
            .values(status="confirming", lease_until=start + store.config.lease_seconds)
        )
    copy = store.tmp_dir / f".copy-{artifact_id}-k1ll3d"
    copy.mkdir(parents=True)
    (copy / ".object.kv.x7q2.tmp").write_bytes(small_kv.read_bytes()[:1000])
    _age(copy, GRACE + 60)
    stray = store.tmp_dir / "tmpab12cd"  # what an older server left there: no name to go by
    stray.mkdir()
    (stray / "object.kv").write_bytes(b"old")

    counts = store.collect(now=start)
    assert counts["temp_files"] == 0 and copy.exists()  # the lease is live
    assert store.collect(now=start + store.config.lease_seconds + 1)["temp_files"] == 1
    assert not copy.exists() and _status(store, artifact_id) == "uploaded"  # handed back, bytes kept
    assert stray.exists()  # young yet
    assert store.collect(now=time.time() + GRACE + 1)["temp_files"] == 1
    assert not stray.exists() and list(store.tmp_dir.iterdir()) == []


def test_a_live_confirms_copy_is_never_collected(s3_app, small_kv, monkeypatch):
    """While a confirm checks its copy, the collector runs with the copy looking older than the
    grace: the copy stays (this process uses it, its lease is live), the confirm succeeds, and the
    copy is gone after."""
    from kvcdn_core import artifact

    store, upload, confirm_upload = s3_app
    artifact_id = upload(small_kv)
    real_check = artifact.check_file
    seen = []

    def collect_meanwhile(path):
        copy = Path(path).parent
        assert copy.parent == store.tmp_dir and copy.name.startswith(f".copy-{artifact_id}-")
        _age(copy, GRACE + 60)
        seen.append(store.collect()["temp_files"])
        seen.append(Path(path).exists())
        return real_check(path)

    monkeypatch.setattr(artifact, "check_file", collect_meanwhile)
    r = confirm_upload(artifact_id)
    assert r.status_code == 200, r.text
    assert seen == [0, True]
    assert list(store.tmp_dir.iterdir()) == []


def test_a_live_confirm_on_another_replica_keeps_its_copy_by_its_lease(s3_app, small_kv):
    """A copy this process does not hold (another replica's, on a shared tmp dir), old, whose upload
    is ``confirming`` with a lease renewed: kept."""
    from kvcdn_server.db import artifacts

    store, upload, _ = s3_app
    artifact_id = upload(small_kv)
    with store.db.begin() as c:
        c.execute(
            artifacts.update()
            .where(artifacts.c.id == artifact_id)
            .values(status="confirming", lease_until=time.time() + 30)
        )
    copy = store.tmp_dir / f".copy-{artifact_id}-0th3r"
    copy.mkdir(parents=True)
    (copy / "object.kv").write_bytes(b"checking")
    _age(copy, GRACE + 60)
    assert store.collect()["temp_files"] == 0 and copy.exists()


def test_a_secret_files_temp_left_by_a_crash_at_start_up_is_collected(s3_app):
    """Creating a secret file writes ``.<name>.<hex>.tmp`` in the server's home first; a crash
    there leaves it. Collected once older than the grace; the home's other files are not touched."""
    store, _, _ = s3_app
    home = Path(store.config.home)
    left = home / ".admin-secret.0a1b2c3d.tmp"
    left.write_text("half")
    other = home / ".not-ours.0a1b2c3d.tmp"
    other.write_text("keep")
    _age(other, GRACE + 60)
    assert store.collect()["temp_files"] == 0 and left.exists()
    assert store.collect(now=time.time() + GRACE + 1)["temp_files"] == 1
    assert not left.exists() and other.exists() and (home / "admin-secret").exists()


FAST_GC = {"KVCDN_GC_INTERVAL": "0.2", "KVCDN_ORPHAN_GRACE": "1", "KVCDN_LEASE_SECONDS": "1"}


def test_kill_9_mid_s3_confirm_leaves_nothing_behind(database_url, moto_s3, tmp_path):
    """The audit's case with a real server: SIGKILL while the local copy of an S3 upload exists,
    restart, and the collector removes the copy (and hands the upload back for another confirm)."""
    home = tmp_path / "home"
    big = tmp_path / "big.kv"
    sha256 = write_large_kv(big, 96 << 20, seed=5)
    args = ["--database", database_url, "--storage", f"s3://{S3_BUCKET}/kill-{tmp_path.name}"]
    env = {**moto_s3.env, **FAST_GC, "KVCDN_QUOTA_STORAGE_BYTES": str(1 << 30)}
    tmp = home / "kvcdn" / "server" / "tmp"
    with services.kvcdn_server(home, args, env) as server:
        key = mint_key(server.url, server.admin_secret(), "acme")
        plan = request_upload(server.url, key, big, sha256=sha256).json()
        put_bytes(plan, big.read_bytes())
        threading.Thread(target=_quietly, args=(confirm, server.url, key, plan["artifact_id"]), daemon=True).start()
        deadline = time.monotonic() + 60
        while not (tmp.is_dir() and any(tmp.iterdir())):
            assert time.monotonic() < deadline, "the confirm never copied the object"
            time.sleep(0.005)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    assert any(tmp.iterdir())  # the crash left the copy
    with services.kvcdn_server(home, args, env):
        deadline = time.monotonic() + 60
        while any(tmp.iterdir()) or _row_status(database_url, plan["artifact_id"]) != "uploaded":
            assert time.monotonic() < deadline, f"left behind: {sorted(p.name for p in tmp.rglob('*'))}"
            time.sleep(0.1)


def _row_status(database_url: str, artifact_id: str) -> str:
    from kvcdn_server.db import database_url as sqlalchemy_url

    engine = sa.create_engine(sqlalchemy_url(database_url), poolclass=sa.pool.NullPool)
    with engine.connect() as c:
        return c.execute(sa.text("SELECT status FROM artifacts WHERE id = :id"), {"id": artifact_id}).scalar_one()


def _quietly(fn, *args):
    with contextlib.suppress(httpx.HTTPError):
        fn(*args)
