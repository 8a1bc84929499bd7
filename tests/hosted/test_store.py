"""The server's state in a real database (SQLite and PostgreSQL): concurrency, crashes, replicas.

Every test here runs ``kvcdn serve`` processes (real HTTP, real processes killed with SIGKILL) or
the app in-process, and checks the end state byte by byte: what was confirmed downloads exactly,
what was not is gone, and the quota counts exactly what is stored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.support import services
from tests.support.budget import budget
from tests.support.hosted import API, bearer, confirm, mint_key, request_upload, upload, write_synthetic_kv

#: a collector that runs all the time and reclaims after 1 s (leases of 1 s): the races of a busy
#: server, and the recovery after a crash, quickly
FAST_GC = {"KVCDN_GC_INTERVAL": "0.2", "KVCDN_ORPHAN_GRACE": "1", "KVCDN_LEASE_SECONDS": "1"}
BIG_QUOTA = {"KVCDN_QUOTA_ARTIFACTS": "10000", "KVCDN_QUOTA_STORAGE_BYTES": str(1 << 40)}


@contextlib.contextmanager
def serve(home: Path, database_url: str, env: dict | None = None):
    with services.kvcdn_server(home, ["--database", database_url], {**BIG_QUOTA, **FAST_GC, **(env or {})}) as server:
        yield server


def db(database_url: str) -> sa.Engine:
    from kvcdn_server.db import database_url as sqlalchemy_url

    return sa.create_engine(sqlalchemy_url(database_url), poolclass=sa.pool.NullPool)


def rows(database_url: str) -> dict[str, tuple[str, int]]:
    """``id → (status, size)`` of every artifact row."""
    with db(database_url).connect() as c:
        return {
            r.id: (r.status, r.size_bytes) for r in c.execute(sa.text("SELECT id, status, size_bytes FROM artifacts"))
        }


def reserved(database_url: str) -> dict[str, tuple[int, int]]:
    with db(database_url).connect() as c:
        return {
            r.tenant: (r.artifacts, r.bytes) for r in c.execute(sa.text("SELECT tenant, artifacts, bytes FROM usage"))
        }


def download(base: str, token: str, artifact_id: str) -> bytes:
    r = httpx.post(f"{base}{API}/artifacts/{artifact_id}/download-url", headers=bearer(token))
    assert r.status_code == 200, r.text
    got = httpx.get(r.json()["download_url"])
    assert got.status_code == 200, got.text
    return got.content


def listed(base: str, token: str) -> set[str]:
    ids, cursor = set(), None
    while True:
        r = httpx.get(
            f"{base}{API}/artifacts",
            params={"limit": 100, **({"cursor": cursor} if cursor else {})},
            headers=bearer(token),
        )
        assert r.status_code == 200, r.text
        ids |= {a["artifact_id"] for a in r.json()["artifacts"]}
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return ids


def objects(home: Path, prefix: str) -> set[str]:
    root = home / "kvcdn" / "server" / "objects" / prefix
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_many_threads_many_uploads_lose_nothing(database_url, tmp_path, progress):
    """4 threads x 50 upload → PUT → confirm in two orgs (two threads each) while the collector runs
    every 0.2 s: every confirmed artifact downloads byte-exact and the quota counts exactly it."""
    files = [write_synthetic_kv(tmp_path / f"a{i}.kv", tokens=4, width=4, seed=i) for i in range(200)]
    home = tmp_path / "home"
    # Leases of 5 s here: a heartbeat starved by this load must not pass for a dead server.
    progress(f"200 uploads from 4 threads against {database_url.split(':')[0]}")
    with serve(home, database_url, {"KVCDN_LEASE_SECONDS": "5"}) as server:
        keys = [mint_key(server.url, server.admin_secret(), slug) for slug in ("one", "two")]
        done: dict[str, tuple[str, Path]] = {}
        errors: list[str] = []

        def work(thread: int):
            key = keys[thread % 2]
            for path in files[thread::4]:
                try:
                    done[upload(server.url, key, path, name=path.name)["artifact_id"]] = (key, path)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(repr(exc))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(done) == 200
        progress("uploads done; checking every download, listing and quota")
        time.sleep(1.5)  # the collector has had its chances (grace 1 s)
        for artifact_id, (key, path) in done.items():
            assert download(server.url, key, artifact_id) == path.read_bytes()
        for key in keys:
            mine = {a for a, (k, _) in done.items() if k == key}
            assert listed(server.url, key) == mine
            usage = httpx.get(f"{server.url}{API}/quota", headers=bearer(key)).json()["usage"]
            assert usage == {
                "artifacts": 100,
                "storage_bytes": sum(done[a][1].stat().st_size for a in mine),
                "pending_artifacts": 0,
                "pending_bytes": 0,
            }
    assert objects(home, "artifacts") == set(done)
    assert objects(home, "uploads") == set()
    assert sorted(reserved(database_url).values()) == sorted(
        (100, sum(p.stat().st_size for k, p in done.values() if k == key)) for key in keys
    )


def _slow_body(total: int, started: threading.Event, data: bytes | None = None, chunk: int = 65536):
    """``total`` bytes (of ``data``, else zeros) in chunks 50 ms apart; ``started`` after the first."""
    data = data if data is not None else bytes(total)
    for offset in range(0, total, chunk):
        yield data[offset : offset + chunk]
        started.set()
        time.sleep(0.05)


def test_killed_mid_put_and_mid_confirm_loses_nothing_and_reclaims_the_rest(database_url, tmp_path, progress):
    home = tmp_path / "home"
    small = [write_synthetic_kv(tmp_path / f"s{i}.kv", tokens=4, width=4, seed=i) for i in range(3)]
    big = write_synthetic_kv(tmp_path / "big.kv", tokens=8192, width=256, seed=7)  # 64 MiB: a slow confirm
    confirmed = {}
    progress("server 1 of 3: killed in the middle of a PUT")
    with serve(home, database_url) as server:
        key = mint_key(server.url, server.admin_secret(), "acme")
        for path in small:
            confirmed[upload(server.url, key, path)["artifact_id"]] = path
        # A PUT that is half-way when the server dies.
        plan = request_upload(server.url, key, big).json()
        started = threading.Event()
        size = big.stat().st_size
        put = threading.Thread(target=_put_quietly, args=(plan["url"], _slow_body(size, started), size))
        put.start()
        assert started.wait(budget(120))
        deadline = time.monotonic() + budget(120)
        while not list((home / "kvcdn" / "server" / "objects" / "uploads").glob(".put-*")):
            assert time.monotonic() < deadline, "the PUT never reached the disk"
            time.sleep(0.01)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        put.join()
        plan_put, killed_put = plan, plan["artifact_id"]
        assert rows(database_url)[killed_put][0] == "uploading"
    progress("server 2 of 3: killed in the middle of a confirm")
    with serve(home, database_url) as server:
        # A confirm that is half-way when the server dies. One that ends before the test sees it
        # running is simply a confirmed artifact (checked below with the others); then try another.
        for _attempt in range(5):
            plan = request_upload(server.url, key, big).json()
            assert httpx.put(plan["url"], content=big.read_bytes()).status_code == 200
            killed_confirm = plan["artifact_id"]
            threading.Thread(target=_quietly, args=(confirm, server.url, key, killed_confirm), daemon=True).start()
            deadline = time.monotonic() + budget(120)
            while (status := rows(database_url)[killed_confirm][0]) not in ("confirming", "ready"):
                assert time.monotonic() < deadline, f"the confirm never started ({status})"
            if status == "confirming":
                break
            confirmed[killed_confirm] = big
        else:
            pytest.fail("five confirms in a row ended before the test saw one running")
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    progress("server 3 of 3: the collector reclaims what the dead ones left")
    with serve(home, database_url) as server:
        # Their leases run out: both are handed back (never failed), the PUT's temp file swept.
        deadline = time.monotonic() + budget(120)
        while (rows(database_url)[killed_put][0], rows(database_url)[killed_confirm][0]) != (
            "pending",
            "uploaded",
        ) or list((home / "kvcdn" / "server" / "objects" / "uploads").glob(".put-*")):
            assert time.monotonic() < deadline, rows(database_url)
            time.sleep(0.1)
        for artifact_id, path in confirmed.items():
            assert download(server.url, key, artifact_id) == path.read_bytes()
        usage = httpx.get(f"{server.url}{API}/quota", headers=bearer(key)).json()["usage"]
        total = sum(p.stat().st_size for p in confirmed.values())
        size = big.stat().st_size
        done = len(confirmed)
        assert usage == {"artifacts": done, "storage_bytes": total, "pending_artifacts": 2, "pending_bytes": 2 * size}
        # The interrupted confirm, retried, succeeds with the bytes it had; the cut PUT is sent again.
        retry = confirm(server.url, key, killed_confirm)
        assert retry.status_code == 200, retry.text
        put_url = f"{server.url}/{plan_put['url'].split('/', 3)[3]}"  # signed for the id, not the host
        assert httpx.put(put_url, content=big.read_bytes()).status_code == 200
        again = confirm(server.url, key, killed_put)
        assert again.status_code == 200, again.text
        for artifact_id in (killed_confirm, killed_put):
            assert download(server.url, key, artifact_id) == big.read_bytes()
            confirmed[artifact_id] = big
    assert objects(home, "artifacts") == set(confirmed)
    assert objects(home, "uploads") == set()
    assert list(reserved(database_url).values()) == [(done + 2, total + 2 * size)]


def _put_quietly(url, body, size):
    with contextlib.suppress(httpx.HTTPError):
        httpx.put(url, content=body, headers={"Content-Length": str(size)})


def _quietly(fn, *args):
    with contextlib.suppress(httpx.HTTPError):
        fn(*args)


def test_two_replicas_on_one_postgresql_and_one_bucket_race_for_the_last_unit(s3_replicas, new_org, small_kv):
    """Quota 3: with 2 confirmed, 12 concurrent upload-urls spread over both replicas: exactly one wins."""
    a, b, admin = s3_replicas
    key = mint_key(a.url, admin, new_org("race"))
    for _ in range(2):
        upload(b.url, key, small_kv)
    barrier = threading.Barrier(12)
    answers: list[int] = []

    def ask(server):
        barrier.wait()
        answers.append(request_upload(server.url, key, small_kv).status_code)

    threads = [threading.Thread(target=ask, args=((a, b)[i % 2],)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [200] + [403] * 11
    usage = httpx.get(f"{a.url}{API}/quota", headers=bearer(key)).json()["usage"]
    assert (usage["artifacts"], usage["pending_artifacts"]) == (2, 1)


def test_parallel_puts_on_one_signed_url_one_writes_the_disk_stays_within_the_quota(tmp_path):
    """12 PUTs at once on one upload URL: one streams at a time, the others get 409 at once; at no
    moment does the disk hold more than the one reserved size."""
    home = tmp_path / "home"
    artifact = write_synthetic_kv(tmp_path / "one.kv", tokens=256, width=64)
    size = artifact.stat().st_size
    with serve(home, f"sqlite:///{tmp_path / 'state.db'}", {"KVCDN_QUOTA_STORAGE_BYTES": str(size)}) as server:
        key = mint_key(server.url, server.admin_secret(), "acme")
        plan = request_upload(server.url, key, artifact).json()
        uploads = home / "kvcdn" / "server" / "objects" / "uploads"
        barrier = threading.Barrier(12)
        answers: list[int] = []
        most = [0]
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                held = sum(p.stat().st_size for p in uploads.glob("*") if p.exists()) if uploads.is_dir() else 0
                most[0] = max(most[0], held)
                time.sleep(0.005)

        def put():
            started = threading.Event()
            barrier.wait()
            try:
                answers.append(
                    httpx.put(
                        plan["url"],
                        content=_slow_body(size, started, artifact.read_bytes()),
                        headers={"Content-Length": str(size)},
                    ).status_code
                )
            except httpx.HTTPError:
                answers.append(0)

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=put) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()
        # Each PUT either streamed alone (200) or met one streaming and was refused at once (409). On
        # a loaded machine a thread may only send its PUT after the first one finished: the upload
        # is open again then, and that PUT streams too (a second 200), still alone.
        assert set(answers) <= {200, 409} and len(answers) == 12, answers
        assert answers.count(200) >= 1 and answers.count(409) >= 1, answers
        assert 0 < most[0] <= size
        done = confirm(server.url, key, plan["artifact_id"])
        assert done.status_code == 200, done.text
        assert download(server.url, key, plan["artifact_id"]) == artifact.read_bytes()
