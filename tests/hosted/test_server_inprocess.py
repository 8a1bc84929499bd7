"""The server app in-process, for what needs settings a shared server cannot take: upload expiry,
a quota that shrinks between upload-url and confirm, the inference timeout, secret handling."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest
from fastapi.testclient import TestClient

from kvcdn_core.errors import KvcdnError
from tests.support.budget import budget
from tests.support.clock import ManualClock
from tests.support.hosted import API, bearer, sha256_of


@pytest.fixture
def make_app(monkeypatch, tmp_path):
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    def make(clock=None, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme")
        monkeypatch.setenv("KVCDN_INFER_DEVICE", "cpu")
        config = load_config(storage=str(tmp_path / "objects"))
        app = create_app(config, clock=clock) if clock else create_app(config)
        from kvcdn_server.apikeys import derive_key

        return app, TestClient(app), derive_key(config.api_key_seed, "acme")

    return make


def _start(client, key, path):
    r = client.post(
        f"{API}/artifacts/upload-url",
        headers=bearer(key),
        json={"name": "a.kv", "size_bytes": path.stat().st_size, "sha256": sha256_of(path)},
    )
    assert r.status_code == 200, r.text
    plan = r.json()
    # TestClient speaks to the app directly: use the path and query of the signed URL.
    url = plan["url"].split("://", 1)[1].split("/", 1)[1]
    return plan, "/" + url


def _files(tmp_path):
    """The objects in storage (PUT temp files are hidden names)."""
    root = tmp_path / "objects"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_unconfirmed_uploads_expire_and_are_removed(make_app, tmp_path, small_kv):
    # The server's own clock, moved on by the test: no sleep, so no race with a busy machine.
    clock = ManualClock()
    app, client, key = make_app(clock=clock, KVCDN_UPLOAD_URL_TTL=60, KVCDN_PENDING_GRACE=0)
    store = app.state.services.store
    plan, put_url = _start(client, key, small_kv)
    assert client.put(put_url, content=small_kv.read_bytes()).status_code == 200
    clock.advance(59)  # still within the URL's lifetime, however long the machine took
    assert client.put(put_url, content=small_kv.read_bytes()).status_code == 200
    clock.advance(2)
    assert client.put(put_url, content=small_kv.read_bytes()).json()["error"] == "url_expired"
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert r.status_code == 410 and r.json()["error"] == "upload_expired"
    assert _files(tmp_path) == []
    assert store.reserved("org:acme") == (0, 0)
    # The collector expires what nobody came back for, and gives its quota back.
    plan2, put2 = _start(client, key, small_kv)
    client.put(put2, content=small_kv.read_bytes())
    assert _files(tmp_path) and store.reserved("org:acme") == (1, small_kv.stat().st_size)
    assert store.collect()["expired"] == 0  # not yet due
    clock.advance(61)
    assert store.collect()["expired"] == 1
    assert _files(tmp_path) == [] and store.reserved("org:acme") == (0, 0)
    assert store.row(plan2["artifact_id"]).status == "expired"


def test_a_failed_confirm_fails_the_upload_and_gives_its_quota_back(make_app, tmp_path, small_kv):
    app, client, key = make_app(KVCDN_QUOTA_ARTIFACTS=1)
    junk = tmp_path / "junk.kv"
    junk.write_bytes(b"\x08" + bytes(40))  # a header length and nothing else
    plan, put_url = _start(client, key, junk)
    assert client.put(put_url, content=junk.read_bytes()).status_code == 200
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert r.status_code == 422 and r.json()["error"] == "not_a_kv_artifact" and "\n" not in r.json()["message"]
    assert app.state.services.store.row(plan["artifact_id"]).status == "failed"
    again = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert again.status_code == 409 and again.json()["error"] == "upload_failed"
    assert _files(tmp_path) == [] and app.state.services.store.reserved("org:acme") == (0, 0)
    # The quota of one artifact is free again.
    plan, put_url = _start(client, key, small_kv)
    assert client.put(put_url, content=small_kv.read_bytes()).status_code == 200
    assert client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key)).status_code == 200


def test_inference_timeout_is_504(make_app, tmp_path, qwen3_artifact, hosted_model, monkeypatch):
    app, client, key = make_app(KVCDN_MODELS=str(hosted_model), KVCDN_INFER_TIMEOUT="0.001", KVCDN_INFER_CONCURRENCY=1)
    plan, put_url = _start(client, key, qwen3_artifact)
    client.put(put_url, content=qwen3_artifact.read_bytes())
    assert client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key)).status_code == 200
    engine = app.state.services.inference
    # Every computation is held until the test lets it go: on a busy machine the second one could
    # otherwise finish within its 1 ms while its waiter was not scheduled, and rightly be served.
    gate, real = threading.Event(), engine._infer
    monkeypatch.setattr(engine, "_infer", lambda *args: gate.wait() and real(*args))
    r = client.post(
        f"{API}/artifacts/{plan['artifact_id']}/infer", headers=bearer(key), json={"question": "x", "n": 64}
    )
    assert r.status_code == 504 and r.json()["error"] == "timeout"
    # Its slot went with the 504, even while the load it started goes on: a second request is
    # admitted (and times out in turn), never 429.
    assert engine.slots.in_use() == 0
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/infer", headers=bearer(key), json={"question": "x", "n": 1})
    assert r.status_code == 504  # held too: it cannot finish first, however the machine schedules it
    gate.set()
    engine.pool.shutdown(wait=True)


def test_a_request_refused_for_its_limits_or_no_slot_costs_no_database_query(make_app, monkeypatch):
    """A flood of refused requests must cost as little as possible: no artifact lookup for them."""
    import uuid

    app, client, key = make_app(KVCDN_INFER_CONCURRENCY=1)
    lookups = []
    real = app.state.services.store.readable
    monkeypatch.setattr(app.state.services.store, "readable", lambda *a, **k: lookups.append(a) or real(*a, **k))
    url = f"{API}/artifacts/{uuid.uuid4()}/infer"
    assert client.post(url, headers=bearer(key), json={"question": "x" * 20000, "n": 1}).status_code == 413
    app.state.services.inference.slots.acquire("another tenant")  # the only slot is taken
    r = client.post(url, headers=bearer(key), json={"question": "x", "n": 1})
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert lookups == []
    app.state.services.inference.slots.release("another tenant")
    assert client.post(url, headers=bearer(key), json={"question": "x", "n": 1}).status_code == 404
    assert len(lookups) == 1


def test_secrets_files_are_private_and_env_overrides(monkeypatch, tmp_path):
    from kvcdn_server.config import load_config, server_home

    config = load_config(storage=str(tmp_path / "o"))
    for name in ("api-key-seed", "admin-secret", "url-signing-key"):
        assert stat.S_IMODE((server_home() / name).stat().st_mode) == 0o600
    assert len(config.created_secrets) == 3
    again = load_config(storage=str(tmp_path / "o"))
    assert again.created_secrets == [] and again.admin_secret == config.admin_secret
    monkeypatch.setenv("KVCDN_ADMIN_SECRET", "from-the-environment-0123456789ab")
    assert load_config(storage=str(tmp_path / "o")).admin_secret == "from-the-environment-0123456789ab"
    for name in ("KVCDN_ADMIN_SECRET", "KVCDN_API_KEY_SEED", "KVCDN_URL_SIGNING_KEY"):
        monkeypatch.setenv(name, "x" * 31)
        with pytest.raises(KvcdnError, match="too short: use at least 32"):
            load_config(storage=str(tmp_path / "o"))
        monkeypatch.setenv(name, "y" * 32)
    monkeypatch.delenv("KVCDN_ADMIN_SECRET")
    os.chmod(server_home() / "admin-secret", 0o644)
    with pytest.raises(KvcdnError, match="chmod 600"):
        load_config(storage=str(tmp_path / "o"))


@pytest.mark.parametrize(
    "url,ok",
    [
        ("https://id.example.com", True),
        ("http://127.0.0.1:9000", True),
        ("http://id.example.com", False),
        ("ftp://x", False),
    ],
)
def test_issuer_must_be_https_unless_loopback(url, ok):
    from kvcdn_server.config import check_issuer_url

    if ok:
        assert check_issuer_url(url) == url
    else:
        with pytest.raises(KvcdnError, match="https"):
            check_issuer_url(url)


def test_hkdf_matches_rfc5869_test_vector():
    from kvcdn_server.apikeys import hkdf_sha256

    # RFC 5869 A.3: SHA-256, zero-length salt and info.
    okm = hkdf_sha256(bytes.fromhex("0b" * 22), b"", 42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8")


def test_telemetry_is_forwarded_with_the_secret(make_app):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received = []

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.headers.get("Authorization"), json.loads(body)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _app, client, _key = make_app(
            KVCDN_TELEMETRY_URL=f"http://127.0.0.1:{server.server_port}/ingest",
            KVCDN_TELEMETRY_SECRET="telemetry-secret",
        )
        event = {"event": "command", "kvcdn_version": "0.1.0", "command": "list", "ok": True}
        assert client.post(f"{API}/telemetry", json=event).status_code == 204
        deadline = time.time() + budget(5)
        while not received and time.time() < deadline:
            time.sleep(0.02)
        assert received == [("Bearer telemetry-secret", event)]
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--issuer-url", "http://id.example.com"], "must use https"),
        (["--storage", "nosuch://bucket"], "no storage backend for 'nosuch://'"),
        (["--storage", "s3://"], "needs a bucket"),
        (["--database", "mysql://db/kvcdn"], "database URL must be postgresql://"),
        (["--database", "postgresql://nobody@127.0.0.1:1/kvcdn"], "cannot open the database"),
    ],
)
def test_bad_configuration_is_one_line_exit_2(args, message):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kvcdn_core", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=budget(60),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_collector_reclaims_orphans_and_never_a_live_object(make_app, tmp_path, small_kv):
    app, client, key = make_app(KVCDN_ORPHAN_GRACE=1)
    store = app.state.services.store
    live, put_url = _start(client, key, small_kv)
    client.put(put_url, content=small_kv.read_bytes())
    assert client.post(f"{API}/artifacts/{live['artifact_id']}/confirm-upload", headers=bearer(key)).status_code == 200
    waiting, put_url = _start(client, key, small_kv)
    client.put(put_url, content=small_kv.read_bytes())  # uploaded, not yet confirmed: alive
    orphan = "11111111-1111-4111-8111-111111111111"  # bytes no row knows (a crash after a delete)
    for key_ in (f"uploads/{orphan}", f"artifacts/{orphan}"):
        store.storage.write_bytes(key_, b"stray")
    temp = store.temp_dir() / f".put-{orphan}-abc"  # a PUT of a server that died
    temp.write_bytes(b"half")
    os.utime(temp, (time.time() - 5, time.time() - 5))
    assert store.collect() == {
        "expired": 0,
        "handed_back": 0,
        "failed": 0,
        "objects": 2,
        "temp_files": 1,
        "multipart": 0,
        "rows": 0,
        "chunks": 0,
    }
    assert _files(tmp_path) == [f"artifacts/{live['artifact_id']}", f"uploads/{waiting['artifact_id']}"]
    assert not temp.exists()


def test_two_confirms_of_one_upload_one_wins(make_app, small_kv):
    """A retried confirm racing the first: exactly one 200, the other a 409 (never a 500)."""
    from concurrent.futures import ThreadPoolExecutor

    app, client, key = make_app()
    plan, put_url = _start(client, key, small_kv)
    client.put(put_url, content=small_kv.read_bytes())
    route = f"{API}/artifacts/{plan['artifact_id']}/confirm-upload"
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: client.post(route, headers=bearer(key)), range(4)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 409, 409, 409], [r.text for r in answers]
    assert {r.json()["error"] for r in answers if r.status_code == 409} <= {"confirm_in_progress", "already_confirmed"}


def test_a_put_during_confirm_cannot_swap_in_unchecked_bytes(make_app, tmp_path, small_kv, monkeypatch):
    """A second PUT with the still-valid URL while confirm checks the bytes is refused (409)."""
    from kvcdn_core import artifact

    app, client, key = make_app()
    plan, put_url = _start(client, key, small_kv)
    assert client.put(put_url, content=small_kv.read_bytes()).status_code == 200
    evil = bytes(small_kv.stat().st_size)
    real_read_header = artifact.read_header
    swapped = []

    def read_then_put(path, *args, **kwargs):
        header = real_read_header(path, *args, **kwargs)
        if not swapped:  # the checks passed; now the attacker's PUT lands
            swapped.append(client.put(put_url, content=evil).status_code)
        return header

    monkeypatch.setattr(artifact, "read_header", read_then_put)
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    monkeypatch.setattr(artifact, "read_header", real_read_header)
    assert swapped == [409] and r.status_code == 200, (swapped, r.text)
    d = client.post(f"{API}/artifacts/{plan['artifact_id']}/download-url", headers=bearer(key)).json()
    got = client.get("/" + d["download_url"].split("://", 1)[1].split("/", 1)[1])
    assert got.content == small_kv.read_bytes()
    assert _files(tmp_path) == [f"artifacts/{plan['artifact_id']}"]


def test_upload_url_quota_is_atomic_in_one_process(make_app, small_kv):
    """Concurrent reservations through the store: never more than the quota."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcdn_server.errors import ApiError

    app, _client, _key = make_app(KVCDN_QUOTA_ARTIFACTS=1)
    store = app.state.services.store

    def reserve(_):
        try:
            store.begin_upload("org:acme", "a.kv", 10, "0" * 64, "private", {})
            return 200
        except ApiError as exc:
            return exc.status

    with ThreadPoolExecutor(16) as pool:
        statuses = sorted(pool.map(reserve, range(16)))
    assert statuses == [200] + [403] * 15


@pytest.fixture
def tiny_issuer():
    """A minimal issuer on 127.0.0.1 whose discovery states its URL with a trailing '/'."""
    import json

    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tests.support.json_http import json_server

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid="k1", use="sig", alg="RS256")
    state = {"down": False, "hits": 0}

    def answer(_method, path, base):
        state["hits"] += 1
        if state["down"]:
            return 503, {}
        return 200, (
            {"issuer": base + "/", "jwks_uri": base + "/jwks"} if path.startswith("/.well-known") else {"keys": [jwk]}
        )

    with json_server(answer) as (base, _seen):
        issuer = base + "/"

        def token(iss: str = issuer) -> str:
            return jwt.encode(
                {"sub": "alice", "iss": iss, "aud": "kvcdn-cli", "exp": int(time.time()) + 300},
                key,
                algorithm="RS256",
                headers={"kid": "k1", "typ": "at+jwt"},
            )

        yield issuer, token, state


def test_an_issuer_whose_url_ends_in_a_slash_can_log_in(tiny_issuer):
    from kvcdn_server.config import check_issuer_url
    from kvcdn_server.oidc import JwtVerifier

    issuer, token, _state = tiny_issuer
    assert check_issuer_url(issuer) == issuer
    for configured in (issuer, issuer.rstrip("/")):  # either spelling finds the same issuer
        claims = JwtVerifier(check_issuer_url(configured), "kvcdn-cli", ["RS256"]).verify(token())
        assert claims.issuer == issuer and claims.subject == "alice"
    from kvcdn_server.errors import ApiError

    with pytest.raises(ApiError):  # iss is compared exactly with what discovery states
        JwtVerifier(issuer, "kvcdn-cli", ["RS256"]).verify(token(issuer.rstrip("/")))


def test_cached_keys_outlive_an_issuer_outage_with_backoff(tiny_issuer):
    from kvcdn_server import oidc

    issuer, token, state = tiny_issuer
    verifier = oidc.JwtVerifier(issuer, "kvcdn-cli", ["RS256"])
    assert verifier.verify(token()).subject == "alice"
    state["down"] = True
    verifier._fetched_at -= oidc.JWKS_TTL + 1  # the keys are due for a refresh, and the issuer is down
    hits = state["hits"]
    for _ in range(5):
        assert verifier.verify(token()).subject == "alice"
    assert state["hits"] == hits + 1  # one failed refresh, then it waits before trying again
    # With no keys at all, a down issuer is a 503, still without hammering it.
    fresh = oidc.JwtVerifier(issuer, "kvcdn-cli", ["RS256"])
    from kvcdn_server.errors import ApiError

    for _ in range(3):
        with pytest.raises(ApiError) as info:
            fresh.verify(token())
        assert info.value.status == 503
    assert state["hits"] == hits + 2


def test_serve_on_a_busy_port_is_one_line_exit_2(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
        proc = subprocess.run(
            [sys.executable, "-m", "kvcdn_core", "serve", "--port", str(port), "--storage", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=budget(60),
            env=env,
        )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: port {port} on 127.0.0.1 is in use (pick another with --port)"]


@pytest.mark.parametrize(
    ("variable", "hint"), [("", "$(cat "), ("from-the-environment-0123456789ab", "$KVCDN_ADMIN_SECRET")]
)
def test_serve_hint_names_where_the_secret_came_from(tmp_path, variable, hint):
    """The hint names the variable when it holds the secret; an empty $KVCDN_ADMIN_SECRET is not the
    secret, so then the hint points at the file that is."""
    import signal
    import subprocess
    import sys

    from tests.support.signals import popen_interruptible

    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "KVCDN_ADMIN_SECRET": variable}
    proc = popen_interruptible(
        [sys.executable, "-m", "kvcdn_core", "serve", "--port", "0", "--storage", str(tmp_path / "o")],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "X-Kvcdn-Admin-Secret" in line:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=budget(30))
    (other,) = {"$(cat ", "$KVCDN_ADMIN_SECRET"} - {hint}
    assert hint in lines[-1] and other not in lines[-1], lines


def test_telemetry_is_rate_limited_per_client(make_app, monkeypatch):
    from kvcdn_server import telemetry

    monkeypatch.setattr(telemetry, "RATE_BURST", 5)
    monkeypatch.setattr(telemetry, "RATE_PER_S", 0.001)
    app, client, _key = make_app()
    event = {"event": "command", "kvcdn_version": "0.1.0", "command": "list", "ok": True}
    statuses = [client.post(f"{API}/telemetry", json=event).status_code for _ in range(8)]
    assert statuses == [204] * 5 + [429] * 3
    # Another client address has a bucket of its own: one noisy client does not silence the rest.
    other = TestClient(app, client=("192.0.2.7", 40000))
    assert [other.post(f"{API}/telemetry", json=event).status_code for _ in range(6)] == [204] * 5 + [429]
    clock = [0.0]
    bucket = telemetry.RateLimit(app.state.services.db_engine, rate=2.0, burst=2, clock=lambda: clock[0])
    assert [bucket.allow("c") for _ in range(3)] == [True, True, False]
    clock[0] += 0.5  # one token back after half a second at 2/s
    assert [bucket.allow("c") for _ in range(2)] == [True, False]


def test_inference_load_locks_stay_bounded():
    from kvcdn_server.inference import InferenceEngine, InferLimits, ModelPolicy

    engine = InferenceEngine(ModelPolicy([]), InferLimits(slots=1, timeout=5.0, cache_bytes=1 << 20, device="cpu"))
    try:
        locks = {id(engine._stripe(engine._artifact_locks, ("t", str(i), "sha"))) for i in range(5000)}
        assert len(locks) <= 64
        key = ("t", "1", "sha")
        assert engine._stripe(engine._artifact_locks, key) is engine._stripe(engine._artifact_locks, key)
    finally:
        engine.shutdown()


def test_loading_an_artifact_and_its_model_cannot_deadlock(monkeypatch):
    """A thread holds its artifact's lock while it loads the model: the two must never be one lock."""
    import kvcdn_server.inference as inference

    monkeypatch.setattr(inference, "LOAD_LOCK_STRIPES", 1)  # every key on the same stripe
    engine = inference.InferenceEngine(
        inference.ModelPolicy([]), inference.InferLimits(slots=1, timeout=5.0, cache_bytes=1 << 20, device="cpu")
    )
    try:
        with engine._stripe(engine._artifact_locks, ("t", "1", "sha")):
            model_lock = engine._stripe(engine._model_locks, "m")
            assert model_lock.acquire(timeout=budget(2))
            model_lock.release()
    finally:
        engine.shutdown()


def test_replicas_racing_for_the_last_slot_exactly_one_gets_it(database_url, tmp_path, monkeypatch):
    """Stores on separate engines (as two replicas have) on one database, 8 threads at once."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvcdn_server.artifacts import ArtifactStore
    from kvcdn_server.config import load_config
    from kvcdn_server.db import open_database
    from kvcdn_server.errors import ApiError

    monkeypatch.setenv("KVCDN_QUOTA_ARTIFACTS", "3")
    config = load_config(storage=str(tmp_path / "objects"), database_url=database_url)
    from kvcdn_core import LocalStorage

    replicas = [
        ArtifactStore(open_database(database_url), LocalStorage(tmp_path / "objects"), config) for _ in range(2)
    ]
    for _ in range(2):
        replicas[0].begin_upload("org:acme", "a.kv", 10, "0" * 64, "private", {})
    start = threading.Barrier(8, timeout=budget(30))

    def reserve(i):
        start.wait()
        try:
            replicas[i % 2].begin_upload("org:acme", "a.kv", 10, "0" * 64, "private", {})
            return 200
        except ApiError as exc:
            return exc.status

    with ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(reserve, range(8)))
    assert statuses == [200] + [403] * 7
    assert replicas[1].usage("org:acme")["pending_artifacts"] == 3 == replicas[0].reserved("org:acme")[0]
