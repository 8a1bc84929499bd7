"""Command behaviour that needs no server: refusals before any request, --to/--from a local
directory through core's LocalStorage, and one-line errors."""

import os

import pytest
from click.testing import CliRunner

from kvcdn_core.cli import make_cli

KEY = "kv_" + "ab" * 32


def run(*args, input=None):
    return CliRunner().invoke(make_cli(), [str(a) for a in args], input=input)


def api_requests(receiver):
    return [r for r in receiver.requests if r[1] != "/api/v1/telemetry"]


@pytest.fixture
def endpoint(receiver, config_home, monkeypatch):
    monkeypatch.setenv("KVCDN_API_URL", receiver.url)
    monkeypatch.setenv("KVCDN_API_KEY", KEY)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    return receiver


@pytest.mark.parametrize("make", ["txt", "garbage-kv", "missing", "directory"])
def test_upload_refuses_before_any_request(endpoint, tmp_path, make):
    path = {"txt": tmp_path / "doc.txt", "garbage-kv": tmp_path / "doc.kv", "missing": tmp_path / "none.kv",
            "directory": tmp_path / "dir.kv"}[make]
    if make == "txt":
        path.write_text("hello")
    elif make == "garbage-kv":
        path.write_bytes(b"\x00" * 64)
    elif make == "directory":
        path.mkdir()
    result = run("upload", path, "--name", "x")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert api_requests(endpoint) == []


def test_unreadable_kv_is_refused(endpoint, kv_file, monkeypatch):
    real_access = os.access
    # the tests may run as root, who reads any file: make this one unreadable to the check itself
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(kv_file) else real_access(p, mode))
    result = run("upload", kv_file, "--name", "x")
    assert result.exit_code == 2 and "not readable" in result.stderr
    assert api_requests(endpoint) == []


def test_401_says_how_to_log_in(endpoint):
    endpoint.routes[("GET", "/api/v1/artifacts")] = lambda h: (401, {}, {"error": "unauthorized",
                                                                         "message": "unknown API key"})
    result = run("list")
    assert result.exit_code == 2
    assert "unknown API key" in result.stderr and "kvcdn login" in result.stderr and "api-key set" in result.stderr


def test_other_failures_say_what_the_server_said(endpoint):
    endpoint.routes[("GET", "/api/v1/quota")] = lambda h: (500, {}, {"error": "internal_error",
                                                                     "message": "something broke"})
    result = run("quota")
    assert result.exit_code == 2 and result.stderr == "error: quota: the server answered 500: something broke\n"


def test_list_follows_pagination(endpoint):
    pages = {None: (["a", "b"], "c1"), "c1": (["c"], "c2"), "c2": ([], None)}

    def listing(h):
        import urllib.parse

        cursor = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(h.path).query)).get("cursor")
        ids, nxt = pages[cursor]
        return 200, {}, {"artifacts": [{"artifact_id": i, "name": i, "size_bytes": 1} for i in ids],
                         "next_cursor": nxt}

    endpoint.routes[("GET", "/api/v1/artifacts")] = listing
    result = run("list", "--format", "ids")
    assert result.exit_code == 0 and result.stdout.split() == ["a", "b", "c"]
    headers = endpoint.requests[0][2]
    assert headers["Authorization"] == f"Bearer {KEY}"


def test_local_directory_round_trip(config_home, kv_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    up = run("upload", kv_file, "--name", "manual", "--to", store)
    assert up.exit_code == 0, up.stderr
    assert up.stdout.strip() == "manual.kv" and (store / "manual.kv").read_bytes() == kv_file.read_bytes()
    listed = run("list", "--from", store, "--format", "ids")
    assert listed.stdout.split() == ["manual.kv"]
    got = run("download", "manual.kv", "--from", store, "--output", tmp_path / "back")
    assert got.exit_code == 0, got.stderr
    assert (tmp_path / "back.kv").read_bytes() == kv_file.read_bytes()  # the .kv suffix rule
    assert "appending '.kv'" in got.stderr
    again = run("download", "manual.kv", "--from", store, "--output", tmp_path / "back.kv")
    assert again.exit_code == 2 and "--force" in again.stderr
    refused = run("delete", "manual.kv", "--from", store)
    assert refused.exit_code == 2 and "--yes" in refused.stderr
    assert run("delete", "manual.kv", "--from", store, "--yes").exit_code == 0
    assert not (store / "manual.kv").exists()


def test_local_download_of_a_non_kv_leaves_nothing(config_home, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "bad.kv").write_bytes(b"\x01" * 40)
    out = tmp_path / "out"
    out.mkdir()
    result = run("download", "bad.kv", "--from", store, "--output", out / "bad.kv")
    assert result.exit_code == 2 and "not a valid .kv" in result.stderr
    assert os.listdir(out) == []


def test_hosted_backend_is_registered():
    from kvcdn_core.plugins import PluginHost
    from kvcdn_hosted.storage import HostedStorage

    backends = PluginHost().storage_backends()
    assert backends["kvcdn"] is HostedStorage and backends["kvcdn+https"] is HostedStorage
    assert backends["file"].__name__ == "LocalStorage"


def test_cli_start_up_is_torch_free():
    import subprocess
    import sys

    code = ("import sys; from kvcdn_core.cli import make_cli; make_cli(); "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
