"""The hosted client end to end against a real ``kvcdn serve`` (local storage and S3 via moto):
upload → list → download (bytes and sha256 equal) → infer → delete, as two tenants that cannot see
each other; an interrupted download leaves nothing; telemetry on and off."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from support import services  # noqa: E402
from support.hosted_client import CountingReceiver, CuttingProxy  # noqa: E402

QUESTION = "What comes next?"


@pytest.fixture(scope="module")
def telemetry_sink():
    sink = CountingReceiver()
    yield sink
    sink.close()


@pytest.fixture(scope="module")
def local_server(tmp_path_factory, qwen3_dir, telemetry_sink):
    data = tmp_path_factory.mktemp("serve-local")
    env = {"KVCDN_TELEMETRY_URL": telemetry_sink.url, "KVCDN_INFER_TIMEOUT": "300"}
    with services.kvcdn_server(data, args=["--models", str(qwen3_dir)], env=env) as server:
        yield server


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory, qwen3_dir):
    data = tmp_path_factory.mktemp("serve-s3")
    with services.moto_s3("kvcdn-client") as s3:
        env = {**s3.env, "KVCDN_INFER_TIMEOUT": "300"}
        with services.kvcdn_server(data, args=["--storage", "s3://kvcdn-client/tenants", "--models", str(qwen3_dir)],
                                   env=env) as server:
            yield server


@pytest.fixture
def kv(cli, monkeypatch):
    """Run kvcdn in-process against one server: ``kv(server, *args, key=...)`` → click Result."""
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    for name in ("KVCDN_API_KEY", "KVCDN_API_URL", "KVCDN_ISSUER_URL", "KVCDN_ADMIN_SECRET"):
        monkeypatch.delenv(name, raising=False)

    def run(server, *args, key=None, admin=False):
        monkeypatch.setenv("KVCDN_API_URL", server.url)
        if key:
            monkeypatch.setenv("KVCDN_API_KEY", key)
        else:
            monkeypatch.delenv("KVCDN_API_KEY", raising=False)
        if admin:
            monkeypatch.setenv("KVCDN_ADMIN_SECRET", server.admin_secret())
        else:
            monkeypatch.delenv("KVCDN_ADMIN_SECRET", raising=False)
        from click.testing import CliRunner

        from kvcdn_core.cli import make_cli

        return CliRunner().invoke(make_cli(), [str(a) for a in args])

    return run


def ok(result):
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result.stdout


def failed(result, code=2):
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.stderr
    return lines[-1]


def mint(kv, server, org):
    key = ok(kv(server, "admin", "mint-api-key", org, admin=True)).strip()
    assert key.startswith("kv_") and len(key) == 67
    return key


def local_continue(cli, artifact, n):
    out = cli("continue", "--kv-path", artifact, "--question", QUESTION, "--n", n, "--device", "cpu",
              "--dtype", "float32", "--format", "json")
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)["token_ids"]


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_two_tenant_workflow(storage, request, kv, cli, qwen3_artifact, tmp_path, monkeypatch):
    server = request.getfixturevalue(f"{storage}_server")
    monkeypatch.chdir(tmp_path)
    acme, globex = mint(kv, server, f"acme-{storage}"), mint(kv, server, f"globex-{storage}")
    assert f"org acme-{storage}" in ok(kv(server, "api-key", "verify", key=acme))

    artifact_id = ok(kv(server, "upload", qwen3_artifact, "--name", "sample", key=acme)).strip()
    listed = json.loads(ok(kv(server, "list", "--format", "json", key=acme)))
    assert [a["artifact_id"] for a in listed] == [artifact_id]
    data = qwen3_artifact.read_bytes()
    assert listed[0]["sha256"] == hashlib.sha256(data).hexdigest() and listed[0]["size_bytes"] == len(data)
    assert "sample" in ok(kv(server, "list", "--long", key=acme))
    assert ok(kv(server, "list", "--format", "ids", key=acme)).split() == [artifact_id]

    out = tmp_path / "down" / "copy.kv"
    assert ok(kv(server, "download", artifact_id, "--output", out, key=acme)).strip() == str(out)
    assert out.read_bytes() == data and hashlib.sha256(out.read_bytes()).hexdigest() == listed[0]["sha256"]
    assert sorted(os.listdir(out.parent)) == ["copy.kv"]

    n = 6
    answer = json.loads(ok(kv(server, "infer", artifact_id, "--question", QUESTION, "--n", n,
                              "--format", "json", key=acme)))
    assert answer["tokens"] == local_continue(cli, qwen3_artifact, n) and answer["token_count"] == n

    # the other tenant sees nothing of it, even knowing the id
    assert ok(kv(server, "list", "--format", "ids", key=globex)).split() == []
    for args in (["download", artifact_id, "--output", tmp_path / "stolen.kv"],
                 ["infer", artifact_id, "--question", "x"], ["delete", artifact_id, "--yes"]):
        assert "404" in failed(kv(server, *args, key=globex)), args
    assert not (tmp_path / "stolen.kv").exists()

    quota = json.loads(ok(kv(server, "quota", "--format", "json", key=acme)))
    assert quota["usage"]["artifacts"] == 1 and quota["usage"]["storage_bytes"] == len(data)
    assert "artifacts" in ok(kv(server, "quota", key=acme))
    who = json.loads(ok(kv(server, "whoami", "--format", "json", key=acme)))
    assert who["org"] == f"acme-{storage}" and who["access_token"] == acme
    assert acme not in ok(kv(server, "whoami", key=acme))  # the table form never shows it

    # a public artifact: the other tenant (and no credential at all) may download it
    public_id = ok(kv(server, "upload", qwen3_artifact, "--name", "pub", "--visibility", "public",
                      key=acme)).strip()
    ok(kv(server, "download", public_id, "--output", tmp_path / "pub-b.kv", key=globex))
    ok(kv(server, "download", public_id, "--output", tmp_path / "pub-anon.kv"))
    assert (tmp_path / "pub-anon.kv").read_bytes() == data

    assert ok(kv(server, "delete", artifact_id, "--yes", key=acme)).strip() == f"deleted {artifact_id}"
    ok(kv(server, "delete", public_id, "--yes", key=acme))
    assert ok(kv(server, "list", "--format", "ids", key=acme)).split() == []
    assert "404" in failed(kv(server, "download", artifact_id, "--output", tmp_path / "gone.kv", key=acme))


def test_errors_are_one_line(kv, local_server, tmp_path):
    assert "kvcdn login" in failed(kv(local_server, "list"))  # no credential at all
    bad = "kv_" + "0" * 64
    line = failed(kv(local_server, "list", key=bad))
    assert "not authenticated" in line and "api-key set" in line
    assert "404" in failed(kv(local_server, "download", "not-a-uuid", "--output", tmp_path / "x.kv",
                              key=bad.replace("0", "1")))
    assert not list(tmp_path.iterdir())


def test_interrupted_download_leaves_no_file(kv, local_server, qwen3_artifact, tmp_path, monkeypatch):
    from kvcdn_hosted import client

    monkeypatch.setattr(client, "BACKOFF_BASE_S", 0.01)
    key = mint(kv, local_server, "cut-tests")
    artifact_id = ok(kv(local_server, "upload", qwen3_artifact, "--name", "cut", key=key)).strip()
    proxy = CuttingProxy(local_server.url)
    try:
        proxied = type(local_server)(proxy.url, local_server.process, local_server.data_dir, local_server.log)
        out = tmp_path / "out"
        out.mkdir()
        line = failed(kv(proxied, "download", artifact_id, "--output", out / "cut.kv", key=key))
        assert "download failed" in line and proxy.cuts == client.ATTEMPTS
        assert os.listdir(out) == []  # no file, no temp file
    finally:
        proxy.close()
        ok(kv(local_server, "delete", artifact_id, "--yes", key=key))


def test_telemetry_on_and_off(kv, local_server, telemetry_sink, monkeypatch):
    key = mint(kv, local_server, "telemetry-tests")
    before = telemetry_sink.count
    monkeypatch.setenv("KVCDN_TELEMETRY", "1")
    from click.testing import CliRunner

    from kvcdn_core.cli import make_cli

    monkeypatch.setenv("KVCDN_API_URL", local_server.url)
    monkeypatch.setenv("KVCDN_API_KEY", key)
    assert CliRunner().invoke(make_cli(), ["list"]).exit_code == 0
    deadline = time.monotonic() + 5
    while telemetry_sink.count == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert telemetry_sink.count == before + 1  # forwarded by the server to its collector
    event = json.loads(telemetry_sink.bodies[-1])
    event = event.get("event", event) if isinstance(event.get("event"), dict) else event
    assert event["command"] == "list" and event["ok"] is True
    assert key not in telemetry_sink.bodies[-1].decode()
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    assert CliRunner().invoke(make_cli(), ["list"]).exit_code == 0
    time.sleep(1.0)
    assert telemetry_sink.count == before + 1


def test_slow_telemetry_receiver_does_not_delay(cli, monkeypatch):
    slow = CountingReceiver(delay=3.0)
    try:
        monkeypatch.setenv("KVCDN_API_URL", slow.url)
        monkeypatch.setenv("KVCDN_TELEMETRY", "0")
        cli("api-key", "clear")  # warm up imports
        started = time.monotonic()
        cli("api-key", "clear")
        baseline = time.monotonic() - started
        monkeypatch.setenv("KVCDN_TELEMETRY", "1")
        started = time.monotonic()
        result = cli("api-key", "clear")
        elapsed = time.monotonic() - started
        assert result.exit_code == 0
        deadline = time.monotonic() + 2
        while slow.count == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow.count == 1  # it was sent, and the command did not wait for the answer
        assert elapsed - baseline < 0.150 + 0.05, (elapsed, baseline)
    finally:
        slow.close()
