"""The server when its database goes away (issue 26, item 2), and a confirm racing a delete.

* A database that cannot be reached is ``503 database_unavailable`` with ``Retry-After`` and one
  log line, never a 500 with a traceback.
* A confirm whose last transaction fails hands its upload back (``uploaded``, bytes kept), so that
  a retried confirm succeeds; when the hand-back cannot be written either, the lease runs out and
  the upload is handed back then (once: a second interruption fails it).
* A real PostgreSQL stopped and started under load: nothing confirmed is lost, nothing is left
  ``confirming``, every upload completes by retrying.
* Deleting an upload while its confirm runs answers the confirm 409 ``upload_failed`` (the upload
  was deleted), on local storage and on S3.

The in-process tests make the database fail at the commit of a chosen transaction and move the
store's clock forward instead of waiting for leases.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy import event

from tests.hosted.conftest import S3_BUCKET
from tests.support import services
from tests.support.hosted import API, bearer, mint_key, request_upload, sha256_of, write_synthetic_kv

TENANT = "org:acme"


@pytest.fixture
def make_app(monkeypatch, tmp_path, database_url):
    """``make_app(storage=None, **env) -> (app, client, key, clock)`` on each database kind; the
    store's clock is real time plus ``clock[0]`` seconds."""
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    def make(storage: str | None = None, **env):
        for name, value in {"KVCDN_API_KEY_ORGS": "acme", "KVCDN_LEASE_SECONDS": "5", **env}.items():
            monkeypatch.setenv(name, str(value))
        config = load_config(storage=storage or str(tmp_path / "objects"), database_url=database_url)
        app = create_app(config)  # not started: no collector thread, the test calls collect()
        clock = [0.0]
        app.state.services.store.clock = lambda: time.time() + clock[0]
        return app, TestClient(app), derive_key(config.api_key_seed, "acme"), clock

    return make


class Outage:
    """Make the database fail like one that went away: from the transaction that makes an upload
    ``ready`` (its commit raises ``OperationalError``), every commit fails while ``down``;
    ``once`` ends the outage right after that first failure."""

    def __init__(self, engine: sa.Engine, once: bool):
        self.once = once
        self.down = False
        self.failed_commits = 0

        @event.listens_for(engine, "before_cursor_execute")
        def _seen(conn, _cursor, statement, parameters, _context, _many):
            values = parameters.values() if isinstance(parameters, dict) else (parameters or ())
            if statement.lstrip().upper().startswith("UPDATE ARTIFACTS") and "ready" in values:
                conn.info[self] = True

        @event.listens_for(engine, "commit")
        def _commit(conn):
            if conn.info.pop(self, False) and not self.failed_commits:
                self.down = True
            if self.down:
                self.failed_commits += 1
                if self.once:
                    self.down = False
                raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))


def _upload(client: TestClient, key: str, path) -> str:
    r = client.post(
        f"{API}/artifacts/upload-url",
        headers=bearer(key),
        json={"name": path.name, "size_bytes": path.stat().st_size, "sha256": sha256_of(path)},
    )
    assert r.status_code == 200, r.text
    plan = r.json()
    if plan["url"].startswith("http://127.0.0.1:8080/"):  # the server's own signed URL: in-process
        put = client.put(plan["url"].split("8080", 1)[1], content=path.read_bytes())
    else:  # a presigned S3 URL
        put = httpx.put(plan["url"], content=path.read_bytes(), headers=plan["headers"])
    assert put.status_code == 200, put.text
    return plan["artifact_id"]


def _confirm(client: TestClient, key: str, artifact_id: str):
    return client.post(f"{API}/artifacts/{artifact_id}/confirm-upload", headers=bearer(key))


def _download(client: TestClient, key: str, artifact_id: str) -> bytes:
    r = client.post(f"{API}/artifacts/{artifact_id}/download-url", headers=bearer(key))
    assert r.status_code == 200, r.text
    return client.get(r.json()["download_url"].split("8080", 1)[1]).content


def _assert_one_line_503(response, caplog) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "database_unavailable"
    assert int(response.headers["Retry-After"]) > 0
    said = [r for r in caplog.records if "database unavailable" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None and "\n" not in said[0].getMessage()


def test_a_confirm_whose_last_transaction_fails_is_handed_back_and_a_retry_succeeds(make_app, small_kv, caplog):
    app, client, key, _ = make_app()
    store = app.state.services.store
    artifact_id = _upload(client, key, small_kv)
    outage = Outage(store.db, once=True)
    with caplog.at_level(logging.WARNING, logger="kvcdn.server"):
        first = _confirm(client, key, artifact_id)
    assert outage.failed_commits == 1
    _assert_one_line_503(first, caplog)
    # The checks had passed: the upload is back where it was, its bytes and reservation kept.
    assert store.row(artifact_id).status == "uploaded"
    assert store.storage.size_of(f"artifacts/{artifact_id}") == small_kv.stat().st_size
    assert store.reserved(TENANT) == (1, small_kv.stat().st_size)
    assert client.get(f"{API}/artifacts/{artifact_id}", headers=bearer(key)).json()["status"] == "pending"
    retry = _confirm(client, key, artifact_id)
    assert retry.status_code == 200, retry.text
    assert retry.json()["status"] == "ready"
    assert _download(client, key, artifact_id) == small_kv.read_bytes()
    assert store.reserved(TENANT) == (1, small_kv.stat().st_size)


def test_when_the_hand_back_fails_too_the_lease_hands_it_back_once(make_app, small_kv, tmp_path, caplog):
    app, client, key, clock = make_app()
    store = app.state.services.store
    lease = store.config.lease_seconds
    artifact_id = _upload(client, key, small_kv)
    outage = Outage(store.db, once=False)
    with caplog.at_level(logging.WARNING, logger="kvcdn.server"):
        first = _confirm(client, key, artifact_id)
    outage.down = False  # the database is back
    assert outage.failed_commits >= 2  # the last transaction, then the hand-back
    _assert_one_line_503(first, caplog)
    assert store.row(artifact_id).status == "confirming"  # nobody could write anything else
    # Its lease has not run out: a retry waits, and so does the collector.
    assert _confirm(client, key, artifact_id).json()["error"] == "confirm_in_progress"
    assert store.collect()["handed_back"] == 0
    # A lease period after the outage, and after the lease: handed back, its bytes still there.
    clock[0] += 2 * lease + 1
    assert store.collect()["handed_back"] == 1
    assert store.row(artifact_id).status == "uploaded"
    assert store.storage.size_of(f"artifacts/{artifact_id}") == small_kv.stat().st_size
    retry = _confirm(client, key, artifact_id)
    assert retry.status_code == 200, retry.text
    assert _download(client, key, artifact_id) == small_kv.read_bytes()

    # A second upload interrupted twice (a file that kills the server checking it) fails.
    other = write_synthetic_kv(tmp_path / "other.kv", tokens=8, seed=3)
    second = _upload(client, key, other)
    for round_ in range(2):
        outage = Outage(store.db, once=False)
        assert _confirm(client, key, second).status_code == 503
        outage.down = False
        clock[0] += 2 * lease + 1
        store.collect()
        assert store.row(second).status == ("uploaded", "failed")[round_]
    refused = _confirm(client, key, second)
    assert refused.status_code == 409 and refused.json()["error"] == "upload_failed"
    assert "interrupted twice" in refused.json()["message"]
    assert store.storage.size_of(f"artifacts/{second}") is None
    assert store.reserved(TENANT) == (1, small_kv.stat().st_size)


def test_a_retried_confirm_takes_back_an_upload_whose_lease_ran_out(make_app, small_kv):
    """The retry does not wait for the collector: a confirm finding its upload ``confirming`` under
    a lease that ran out (a lease period after the outage) hands it back and confirms it."""
    app, client, key, clock = make_app()
    store = app.state.services.store
    artifact_id = _upload(client, key, small_kv)
    outage = Outage(store.db, once=False)
    assert _confirm(client, key, artifact_id).status_code == 503
    outage.down = False
    clock[0] += 2 * store.config.lease_seconds + 1
    retry = _confirm(client, key, artifact_id)
    assert retry.status_code == 200, retry.text
    assert _download(client, key, artifact_id) == small_kv.read_bytes()


def test_every_route_answers_503_while_the_database_is_unreachable(make_app, small_kv, caplog):
    """The engine pointed at a port nobody listens on: reads, writes, and authentication alike."""
    app, client, key, _ = make_app()
    artifact_id = _upload(client, key, small_kv)
    store = app.state.services.store
    dead = sa.create_engine(
        f"postgresql+psycopg://nobody@127.0.0.1:{services.free_port()}/none", connect_args={"connect_timeout": 5}
    )
    for holder in (store, app.state.services.orgs):
        holder.db = dead
    store.reads = dead
    app.state.services.orgs._loaded_at = float("-inf")  # the key cache is stale: authentication needs the database
    with caplog.at_level(logging.WARNING, logger="kvcdn.server"):
        answers = [
            client.get(f"{API}/artifacts", headers=bearer(key)),
            client.get(f"{API}/artifacts/{artifact_id}", headers=bearer(key)),
            _confirm(client, key, artifact_id),
            client.delete(f"{API}/artifacts/{artifact_id}", headers=bearer(key)),
            client.get(f"{API}/quota", headers=bearer(key)),
        ]
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"] == "database_unavailable" and answer.headers["Retry-After"]
    lines = [r for r in caplog.records if "database unavailable" in r.getMessage()]
    assert len(lines) == len(answers) and all(r.exc_info is None for r in lines)


# -- a confirm racing a delete of its own upload --------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def storage_uri(request):
    if request.param == "local":
        return None
    moto = request.getfixturevalue("moto_s3")
    mp = request.getfixturevalue("monkeypatch")
    for name, value in moto.env.items():
        mp.setenv(name, value)
    return f"s3://{S3_BUCKET}/race-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("when", ["moved", "reading"])
def test_deleting_an_upload_while_its_confirm_runs_is_409_deleted(make_app, storage_uri, small_kv, when):
    """The delete lands after the confirm moved the bytes, or as it starts reading them."""
    app, client, key, _ = make_app(storage=storage_uri)
    store = app.state.services.store
    artifact_id = _upload(client, key, small_kv)

    def delete_now():
        store.delete(TENANT, artifact_id)

    if when == "moved":
        rename = store.storage.rename

        def rename_then_delete(source, target):
            rename(source, target)
            delete_now()

        store.storage.rename = rename_then_delete
    else:
        local_copy = store.local_copy

        @contextlib.contextmanager
        def delete_then_read(object_key):
            delete_now()
            with local_copy(object_key) as path:
                yield path

        store.local_copy = delete_then_read
    r = _confirm(client, key, artifact_id)
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "upload_failed" and "deleted" in r.json()["message"]
    assert store.row(artifact_id) is None
    assert [o.key for o in store.storage.list("") if artifact_id in o.key] == []
    assert store.reserved(TENANT) == (0, 0)


# -- a real PostgreSQL stopped and started under load ---------------------------------------------


def test_postgresql_stopped_and_started_under_load_loses_and_strands_nothing(tmp_path):
    """Six uploaders (two with 64 MiB files, whose confirms take a while) against ``kvcdn serve`` on
    its own PostgreSQL, which is stopped while confirms are in flight and started again once every
    uploader has been answered 503 and the outage has outlasted the 3 s leases. While it is down every 5xx is ``503 database_unavailable`` with
    ``Retry-After``; afterwards every upload completes by retrying (confirms that got a 503 among
    them), downloads byte-exact, and nothing is left ``confirming``, ``uploading`` or pending."""
    small = [write_synthetic_kv(tmp_path / f"s{i}.kv", tokens=64, width=32, seed=i) for i in range(16)]
    big = [write_synthetic_kv(tmp_path / f"b{i}.kv", tokens=16384, width=128, seed=100 + i) for i in range(4)]
    work = [big[0::2], big[1::2], *(small[i::4] for i in range(4))]
    env = {
        "KVCDN_QUOTA_ARTIFACTS": "1000",
        "KVCDN_QUOTA_STORAGE_BYTES": str(1 << 40),
        "KVCDN_GC_INTERVAL": "0.2",
        "KVCDN_ORPHAN_GRACE": "1",
        "KVCDN_LEASE_SECONDS": "3",
    }
    answers: list[tuple[str, int, str | None, str | None]] = []  # (step, status, error code, Retry-After)
    answered_503: set[int] = set()  # threads that were answered 503 at least once
    confirmed_after_503: set[str] = set()
    done: dict[str, object] = {}
    errors: list[str] = []

    def until_done(step: str, call, waits: frozenset[str]) -> tuple[httpx.Response, bool]:
        """Send until the answer is neither a 503 nor a 409 in ``waits`` (the upload's previous
        attempt still holds it until its lease runs out); the answer, and whether a 503 came."""
        deadline = time.monotonic() + 300
        got_503 = False
        while True:
            r = call()
            code = r.json().get("error") if r.status_code >= 400 else None
            answers.append((step, r.status_code, code, r.headers.get("Retry-After")))
            if r.status_code == 503:
                got_503 = True
                answered_503.add(threading.get_ident())
            elif not (r.status_code == 409 and code in waits):
                return r, got_503
            assert time.monotonic() < deadline, f"{step} never went through: {r.text}"
            time.sleep(0.1)

    with services.postgres() as pg:
        url = pg.new_database("outage")
        with services.kvcdn_server(tmp_path / "home", ["--database", url], env) as server:
            key = mint_key(server.url, server.admin_secret(), "acme")

            def upload_one(path) -> str:
                r, _ = until_done("upload-url", lambda: request_upload(server.url, key, path), frozenset())
                assert r.status_code == 200, r.text
                plan = r.json()
                artifact_id = plan["artifact_id"]
                put = lambda: httpx.put(plan["url"], content=path.read_bytes(), headers=plan["headers"])  # noqa: E731
                r, _ = until_done("put", put, frozenset({"upload_in_progress"}))
                assert r.status_code == 200, r.text
                route = f"{server.url}{API}/artifacts/{artifact_id}/confirm-upload"
                confirm = lambda: httpx.post(route, json={}, headers=bearer(key))  # noqa: E731
                r, got_503 = until_done("confirm", confirm, frozenset({"confirm_in_progress"}))
                assert r.status_code == 200, r.text
                if got_503:
                    confirmed_after_503.add(artifact_id)
                return artifact_id

            def uploader(paths):
                for path in paths:
                    try:
                        done[upload_one(path)] = path
                    except Exception as exc:  # noqa: BLE001 - reported below
                        errors.append(f"{path.name}: {exc!r}")

            engine = sa.create_engine(sa.make_url(url.replace("postgresql://", "postgresql+psycopg://")))
            threads = [threading.Thread(target=uploader, args=(paths,)) for paths in work]
            for t in threads:
                t.start()
            # Stop the database while a big confirm is checking its bytes.
            in_flight = sa.text("SELECT count(*) FROM artifacts WHERE status = 'confirming' AND size_bytes > 1000000")
            deadline = time.monotonic() + 120
            while True:
                with engine.connect() as c:
                    if c.execute(in_flight).scalar():
                        break
                assert time.monotonic() < deadline, "no big confirm was ever in flight"
                time.sleep(0.01)
            engine.dispose()
            pg.stop()
            stopped = time.monotonic()
            # Start it again once every uploader still at work has been answered (503) meanwhile, and
            # the outage has outlasted the leases (their heartbeats could not renew them).
            deadline = stopped + 120
            while {t.ident for t in threads if t.is_alive()} - answered_503 or time.monotonic() < stopped + 7:
                assert time.monotonic() < deadline, (
                    f"uploaders not answered while the database was down: {answers[-10:]}"
                )
                time.sleep(0.05)
            pg.start()
            for t in threads:
                t.join()
            assert not errors, errors
            assert len(done) == len(small) + len(big)

            # While it was down: 503 database_unavailable with Retry-After, never a 500.
            assert not [a for a in answers if a[1] >= 500 and a[1] != 503], answers
            assert all(code == "database_unavailable" and after for _, status, code, after in answers if status == 503)
            assert confirmed_after_503, "no confirm was answered 503 and then retried"
            # Afterwards: every artifact downloads byte-exact, and nothing is left in between.
            for artifact_id, path in done.items():
                r = httpx.post(f"{server.url}{API}/artifacts/{artifact_id}/download-url", headers=bearer(key))
                assert r.status_code == 200, r.text
                assert httpx.get(r.json()["download_url"]).content == path.read_bytes()
            usage = httpx.get(f"{server.url}{API}/quota", headers=bearer(key)).json()["usage"]
            assert usage["artifacts"] == len(done) and usage["pending_artifacts"] == 0
            engine = sa.create_engine(sa.make_url(url.replace("postgresql://", "postgresql+psycopg://")))
            with engine.connect() as c:
                states = dict(c.execute(sa.text("SELECT status, count(*) FROM artifacts GROUP BY status")).all())
            engine.dispose()
            assert states == {"ready": len(done)}
            log = "".join(server.log)
            assert "Traceback" not in log and "database unavailable" in log
