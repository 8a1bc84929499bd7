"""The server app in-process, for what needs settings a shared server cannot take: upload expiry,
a quota that shrinks between upload-url and confirm, the inference timeout, secret handling."""

from __future__ import annotations

import os
import stat
import time

import pytest
from fastapi.testclient import TestClient

from kvcdn_core.errors import KvcdnError
from tests.support.hosted import API, bearer, sha256_of


@pytest.fixture
def make_app(monkeypatch, tmp_path):
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    def make(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme")
        monkeypatch.setenv("KVCDN_INFER_DEVICE", "cpu")
        config = load_config(storage=str(tmp_path / "objects"))
        app = create_app(config)
        from kvcdn_server.apikeys import derive_key

        return app, TestClient(app), derive_key(config.api_key_seed, "acme")

    return make


def _start(client, key, path):
    r = client.post(f"{API}/artifacts/upload-url", headers=bearer(key),
                    json={"name": "a.kv", "size_bytes": path.stat().st_size, "sha256": sha256_of(path)})
    assert r.status_code == 200, r.text
    plan = r.json()
    # TestClient speaks to the app directly: use the path and query of the signed URL.
    url = plan["url"].split("://", 1)[1].split("/", 1)[1]
    return plan, "/" + url


def _files(tmp_path):
    root = tmp_path / "objects"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
                  and not p.name.startswith("acme"))


def test_unconfirmed_uploads_expire_and_are_removed(make_app, tmp_path, small_kv):
    app, client, key = make_app(KVCDN_UPLOAD_URL_TTL=1, KVCDN_PENDING_GRACE=0)
    plan, put_url = _start(client, key, small_kv)
    assert client.put(put_url, content=small_kv.read_bytes()).status_code == 200
    time.sleep(2.1)
    assert client.put(put_url, content=small_kv.read_bytes()).json()["error"] == "url_expired"
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert r.status_code == 410 and r.json()["error"] == "upload_expired"
    assert _files(tmp_path) == []
    # The periodic sweep removes what nobody came back for.
    plan2, put2 = _start(client, key, small_kv)
    client.put(put2, content=small_kv.read_bytes())
    assert _files(tmp_path)
    time.sleep(2.1)
    assert app.state.store.sweep_all() == 1
    assert _files(tmp_path) == []


def test_quota_is_checked_again_at_confirm(make_app, tmp_path, small_kv):
    app, client, key = make_app()
    plan, put_url = _start(client, key, small_kv)
    client.put(put_url, content=small_kv.read_bytes())
    app.state.store.config.quota_bytes = small_kv.stat().st_size - 1  # lowered by the operator meanwhile
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert r.status_code == 403 and r.json()["error"] == "quota_exceeded"
    assert _files(tmp_path) == []


def test_inference_timeout_is_504(make_app, tmp_path, qwen3_artifact, hosted_model):
    app, client, key = make_app(KVCDN_MODELS=str(hosted_model), KVCDN_INFER_TIMEOUT="0.001",
                                KVCDN_INFER_CONCURRENCY=1)
    plan, put_url = _start(client, key, qwen3_artifact)
    client.put(put_url, content=qwen3_artifact.read_bytes())
    assert client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key)).status_code == 200
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/infer", headers=bearer(key), json={"question": "x", "n": 64})
    assert r.status_code == 504 and r.json()["error"] == "timeout"
    # Its slot stays taken until the computation really ends: meanwhile a second request is 429.
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/infer", headers=bearer(key), json={"question": "x", "n": 1})
    assert r.status_code in (429, 504)
    app.state.engine.pool.shutdown(wait=True)


def test_secrets_files_are_private_and_env_overrides(monkeypatch, tmp_path):
    from kvcdn_server.config import load_config, server_home

    config = load_config(storage=str(tmp_path / "o"))
    for name in ("api-key-seed", "admin-secret", "url-signing-key"):
        assert stat.S_IMODE((server_home() / name).stat().st_mode) == 0o600
    assert len(config.created_secrets) == 3
    again = load_config(storage=str(tmp_path / "o"))
    assert again.created_secrets == [] and again.admin_secret == config.admin_secret
    monkeypatch.setenv("KVCDN_ADMIN_SECRET", "from-the-environment-0123456789")
    assert load_config(storage=str(tmp_path / "o")).admin_secret == "from-the-environment-0123456789"
    monkeypatch.setenv("KVCDN_ADMIN_SECRET", "short")
    with pytest.raises(KvcdnError, match="too short"):
        load_config(storage=str(tmp_path / "o"))
    monkeypatch.delenv("KVCDN_ADMIN_SECRET")
    os.chmod(server_home() / "admin-secret", 0o644)
    with pytest.raises(KvcdnError, match="chmod 600"):
        load_config(storage=str(tmp_path / "o"))


@pytest.mark.parametrize("url,ok", [("https://id.example.com", True), ("http://127.0.0.1:9000", True),
                                    ("http://id.example.com", False), ("ftp://x", False)])
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
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
                         "9d201395faa4b61a96c8")


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
        _app, client, _key = make_app(KVCDN_TELEMETRY_URL=f"http://127.0.0.1:{server.server_port}/ingest",
                                      KVCDN_TELEMETRY_SECRET="telemetry-secret")
        event = {"event": "command", "kvcdn_version": "0.1.0", "command": "list", "ok": True}
        assert client.post(f"{API}/telemetry", json=event).status_code == 204
        deadline = time.time() + 5
        while not received and time.time() < deadline:
            time.sleep(0.02)
        assert received == [("Bearer telemetry-secret", event)]
    finally:
        server.shutdown()


@pytest.mark.parametrize("args,message", [
    (["--issuer-url", "http://id.example.com"], "must use https"),
    (["--storage", "nosuch://bucket"], "no storage backend for 'nosuch://'"),
    (["--storage", "s3://"], "needs a bucket"),
])
def test_bad_configuration_is_one_line_exit_2(args, message):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvcdn_core", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_orphans_of_an_interrupted_confirm_are_swept(make_app, tmp_path, small_kv):
    from kvcdn_server.artifacts import tenant_of

    app, client, key = make_app()
    tenant = tenant_of("org:acme")
    store = app.state.store
    orphan_id = "11111111-1111-4111-8111-111111111111"
    for suffix in (".kv", ".upload"):
        store.storage.write_bytes(store.key(tenant, orphan_id, suffix), small_kv.read_bytes())
    assert store.usage(tenant, sweep=False)["artifacts"] == 0
    assert _files(tmp_path)
    store.usage(tenant)
    assert _files(tmp_path) == []
    # A retried confirm racing the first: the second finds the bytes gone and gets 409, not 500.
    plan, put_url = _start(client, key, small_kv)
    client.put(put_url, content=small_kv.read_bytes())
    original = store.storage.rename

    def first_confirm_wins(source, target):
        original(source, target)  # the other confirm moves the bytes...
        original(source, target)  # ...so this one finds its source gone

    store.storage.rename = first_confirm_wins
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert r.status_code == 409 and r.json()["error"] == "already_confirmed"


def test_a_put_during_confirm_cannot_swap_in_unchecked_bytes(make_app, tmp_path, small_kv, monkeypatch):
    """A second PUT with the still-valid URL, landing after confirm checked the bytes, changes nothing."""
    from kvcdn_core import artifact as kvformat

    app, client, key = make_app()
    plan, put_url = _start(client, key, small_kv)
    assert client.put(put_url, content=small_kv.read_bytes()).status_code == 200
    evil = bytes(small_kv.stat().st_size)
    real_read_header = kvformat.read_header
    swapped = []

    def read_then_put(path, *args, **kwargs):
        header = real_read_header(path, *args, **kwargs)
        if not swapped:  # the checks passed; now the attacker's PUT lands
            swapped.append(client.put(put_url, content=evil).status_code)
        return header

    monkeypatch.setattr(kvformat, "read_header", read_then_put)
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    monkeypatch.setattr(kvformat, "read_header", real_read_header)
    assert swapped == [200] and r.status_code == 200, (swapped, r.text)
    d = client.post(f"{API}/artifacts/{plan['artifact_id']}/download-url", headers=bearer(key)).json()
    got = client.get("/" + d["download_url"].split("://", 1)[1].split("/", 1)[1])
    assert got.content == small_kv.read_bytes()
    # The stray bytes are swept, and the confirmed artifact stays.
    client.get(f"{API}/quota", headers=bearer(key))
    assert [f for f in _files(tmp_path) if f.endswith((".upload", ".confirming"))] == []
    assert any(f.endswith(".kv") for f in _files(tmp_path))


def test_upload_url_quota_is_atomic_in_one_process(make_app, small_kv):
    """Concurrent reservations through the store: never more than the quota."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcdn_server.errors import ApiError

    app, _client, _key = make_app(KVCDN_QUOTA_ARTIFACTS=1)
    store = app.state.store
    real_usage = store.usage

    def slow_usage(*args, **kwargs):  # widen the window between the check and the write
        found = real_usage(*args, **kwargs)
        time.sleep(0.02)
        return found

    store.usage = slow_usage

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
        return 200, ({"issuer": base + "/", "jwks_uri": base + "/jwks"} if path.startswith("/.well-known")
                     else {"keys": [jwk]})

    with json_server(answer) as (base, _seen):
        issuer = base + "/"

        def token(iss: str = issuer) -> str:
            return jwt.encode({"sub": "alice", "iss": iss, "aud": "kvcdn-cli", "exp": int(time.time()) + 300},
                              key, algorithm="RS256", headers={"kid": "k1", "typ": "at+jwt"})

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
        proc = subprocess.run([sys.executable, "-m", "kvcdn_core", "serve", "--port", str(port),
                               "--storage", str(tmp_path / "o")], capture_output=True, text=True, timeout=60,
                              env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: port {port} on 127.0.0.1 is in use (pick another with --port)"]


def test_serve_hint_names_the_secret_file_when_the_variable_is_empty(tmp_path):
    """An empty $KVCDN_ADMIN_SECRET is not the secret: the hint must point at the file that is."""
    import signal
    import subprocess
    import sys

    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "KVCDN_ADMIN_SECRET": ""}
    proc = subprocess.Popen([sys.executable, "-m", "kvcdn_core", "serve", "--port", "0", "--storage",
                             str(tmp_path / "o")], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "X-Kvcdn-Admin-Secret" in line:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert "admin-secret)" in lines[-1] and "$KVCDN_ADMIN_SECRET" not in lines[-1], lines


def test_telemetry_is_rate_limited_per_process(make_app, monkeypatch):
    from kvcdn_server import telemetry

    monkeypatch.setattr(telemetry, "RATE_BURST", 5)
    monkeypatch.setattr(telemetry, "RATE_PER_S", 0.001)
    _app, client, _key = make_app()
    event = {"event": "command", "kvcdn_version": "0.1.0", "command": "list", "ok": True}
    statuses = [client.post(f"{API}/telemetry", json=event).status_code for _ in range(8)]
    assert statuses == [204] * 5 + [429] * 3
    clock = [0.0]
    bucket = telemetry.RateLimit(rate=2.0, burst=2, clock=lambda: clock[0])
    assert [bucket.allow() for _ in range(3)] == [True, True, False]
    clock[0] += 0.5  # one token back after half a second at 2/s
    assert [bucket.allow() for _ in range(2)] == [True, False]


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
    engine = inference.InferenceEngine(inference.ModelPolicy([]),
                                       inference.InferLimits(slots=1, timeout=5.0, cache_bytes=1 << 20, device="cpu"))
    try:
        with engine._stripe(engine._artifact_locks, ("t", "1", "sha")):
            model_lock = engine._stripe(engine._model_locks, "m")
            assert model_lock.acquire(timeout=2)
            model_lock.release()
    finally:
        engine.shutdown()


def test_two_replicas_racing_for_the_last_slot_never_both_get_it(make_app):
    """Two stores on one storage (two replicas: no shared lock) reserve at the same instant."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvcdn_server.artifacts import ArtifactStore
    from kvcdn_server.errors import ApiError

    app, _client, _key = make_app(KVCDN_QUOTA_ARTIFACTS=1)
    first = app.state.store
    replicas = [first, ArtifactStore(first.storage, first.config)]
    both_checked = threading.Barrier(2, timeout=30)

    def reserve(store):
        real_save = store.save_pending

        def wait_then_save(tenant, record):
            # Both replicas passed the first quota check before either record exists: the race.
            both_checked.wait()
            real_save(tenant, record)

        store.save_pending = wait_then_save
        try:
            store.begin_upload("org:acme", "a.kv", 10, "0" * 64, "private", {})
            return 200
        except ApiError as exc:
            return exc.status

    with ThreadPoolExecutor(2) as pool:
        statuses = list(pool.map(reserve, replicas))
    assert statuses.count(200) <= 1, statuses
    from kvcdn_server.artifacts import tenant_of

    assert first.usage(tenant_of("org:acme"))["pending_artifacts"] == statuses.count(200)
