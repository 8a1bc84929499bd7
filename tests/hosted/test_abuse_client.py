"""The hosted client against weird servers, racing processes and plain http (issue 13, items 5 and 7).

* A server answering JSON of unexpected shapes gets one error line and exit 2, never a traceback.
* Processes refreshing one login session at once, against the real issuer (which rotates refresh
  tokens on every use), all succeed and leave a refresh token that still works.
* Downloaded artifacts follow the umask like generated ones; credentials stay 0600.
* ``kvcdn admin`` warns before sending the admin secret over plain http to a remote host.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time

import httpx
import pytest

from tests.support import kvfiles, services
from tests.support.budget import budget
from tests.support.json_http import json_server

KEY = "kv_" + "ab" * 32


@pytest.fixture
def weird_server():
    """``weird_server(answers) -> url``: a loopback server answering ``{(method, path prefix): body}``."""
    with contextlib.ExitStack() as stack:

        def start(answers: dict) -> str:
            def answer(method, path, _base):
                found = [body for (m, prefix), body in answers.items() if m == method and path.startswith(prefix)]
                return (200, found[0]) if found else (404, {})

            return stack.enter_context(json_server(answer))[0]

        yield start


A = "/api/v1/artifacts"
WEIRD = {
    "list: items that are not objects": ({("GET", A): {"artifacts": [1, "x", None]}}, ["list"]),
    "list: a page that is a string": ({("GET", A): "page"}, ["list"]),
    # no kvcdn server answered these shapes; the client read them until its reads were typed
    "list: artifacts under another key": ({("GET", A): {"items": [{"artifact_id": "a", "name": "a"}]}}, ["list"]),
    "list: a bare array": ({("GET", A): [{"artifact_id": "a", "name": "a", "size_bytes": 1}]}, ["list"]),
    "download: url for download_url": (
        {("POST", A): {"url": "/x", "size_bytes": 8}, ("GET", "/x"): b"12345678"},
        ["download", "abc", "-o", "{tmp}/x.kv"],
    ),
    "list --format ids: items that are lists": ({("GET", A): {"artifacts": [[1], [2]]}}, ["list", "--format", "ids"]),
    "whoami: a list": ({("GET", "/api/v1/whoami"): [1, 2]}, ["whoami"]),
    "quota: limits of the wrong types": ({("GET", "/api/v1/quota"): {"limits": [1], "usage": "x"}}, ["quota"]),
    "download: a url that is an object": (
        {("POST", A): {"download_url": {"x": 1}, "size_bytes": 5}},
        ["download", "abc", "-o", "{tmp}/x.kv"],
    ),
    "download: a size that is not a number": (
        {("POST", A): {"download_url": "/x", "size_bytes": "big"}},
        ["download", "abc", "-o", "{tmp}/x.kv"],
    ),
    "download: a sha256 that is a number": (
        {("POST", A): {"download_url": "/x", "size_bytes": 8, "sha256": 5}, ("GET", "/x"): b"12345678"},
        ["download", "abc", "-o", "{tmp}/x.kv"],
    ),
    "upload: a grant that is a list": ({("POST", A): []}, ["upload", "{kv}", "--name", "n"]),
    "upload: parts without numbers": (
        {
            ("POST", A): {
                "artifact_id": "a",
                "multipart": {"part_size": 8, "parts": [{"part_number": "one", "url": "/p"}]},
            }
        },
        ["upload", "{kv}", "--name", "n"],
    ),
    "infer: an answer that is a string": ({("POST", A): "tokens"}, ["infer", "abc", "--question", "q", "--n", "1"]),
}


#: (answers, command, exit code if not 2): each answer is read into its kvcdn-wire model before it is
#: used, so a number where the sha256 belongs is an answer of the wrong shape (2), not a failed check
@pytest.mark.parametrize("case", sorted(WEIRD))
def test_weird_server_answers_are_one_line_and_exit_2(case, weird_server, cli, tmp_path, monkeypatch):
    answers, args, *code = WEIRD[case]
    url = weird_server(answers)
    kv = tmp_path / "ok.kv"
    kv.write_bytes(kvfiles.valid_bytes())
    monkeypatch.setenv("KVCDN_API_URL", url)
    monkeypatch.setenv("KVCDN_API_KEY", KEY)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    result = cli(*[a.format(tmp=tmp_path, kv=kv) for a in args])
    assert result.exit_code == (code or [2])[0], (case, result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "x.kv").exists()


def test_concurrent_refreshes_keep_the_rotated_refresh_token(oidc_issuer, tmp_path):
    """Six processes find the session expired at once; the issuer rotates the refresh token on use."""
    from kvcdn_hosted import oidc

    tokens = services.device_flow_token(oidc_issuer.url, "alice", scope="openid offline_access kvcdn")
    assert tokens.get("refresh_token")
    with httpx.Client() as http:
        meta = oidc.discover(http, oidc_issuer.url)
    session = oidc.session_from_tokens(tokens, meta, oidc_issuer.url, "kvcdn-cli", None)
    session["expires_at"] = time.time() - 1  # every process must refresh before use
    home = tmp_path / "config"
    (home / "kvcdn").mkdir(parents=True, mode=0o700)
    (home / "kvcdn" / "credentials.json").write_text(json.dumps({"session": session}))
    os.chmod(home / "kvcdn" / "credentials.json", 0o600)

    start_at = time.time() + 3.0  # all processes are imported and waiting by then
    script = (
        "import sys, time\n"
        "from kvcdn_hosted.client import resolve_credential\n"
        "from kvcdn_hosted.config import load_settings\n"
        "settings = load_settings()\n"
        "time.sleep(max(0.0, float(sys.argv[1]) - time.time()))\n"
        "print(resolve_credential(settings).token)\n"
    )
    env = {**os.environ, "XDG_CONFIG_HOME": str(home), "KVCDN_ISSUER_URL": oidc_issuer.url}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(start_at)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(6)
    ]
    results = [p.communicate(timeout=budget(60)) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0 and out.strip(), err
    stored = json.loads((home / "kvcdn" / "credentials.json").read_text())["session"]
    assert stored["refresh_token"] != session["refresh_token"]  # rotated
    assert stat.S_IMODE((home / "kvcdn" / "credentials.json").stat().st_mode) == 0o600
    # The stored refresh token is the live one: the issuer still accepts it.
    with httpx.Client() as http:
        again = oidc.refresh(http, stored)
    assert again["access_token"]


def test_downloads_follow_the_umask_and_credentials_stay_private(local_server, org_key, tmp_path, cli, monkeypatch):
    from tests.support.hosted import upload

    key = org_key("perm")
    source = tmp_path / "src.kv"
    source.write_bytes(kvfiles.valid_bytes())
    artifact_id = upload(local_server.url, key, source)["artifact_id"]
    monkeypatch.setenv("KVCDN_API_URL", local_server.url)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    old = os.umask(0o022)
    try:
        assert cli("api-key", "set", key).exit_code == 0
        result = cli("download", artifact_id, "-o", tmp_path / "got.kv")
        assert result.exit_code == 0, result.stderr
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "got.kv").stat().st_mode) == 0o644
    from kvcdn_hosted.credentials import credentials_path

    assert stat.S_IMODE(credentials_path().stat().st_mode) == 0o600


def test_admin_warns_before_sending_its_secret_over_plain_http(local_server, cli, monkeypatch):
    port = local_server.url.rsplit(":", 1)[1]
    monkeypatch.setenv("KVCDN_ADMIN_SECRET", local_server.admin_secret())
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    remote = cli("admin", "mint-api-key", "warned-org", "--api-url", f"http://0.0.0.0:{port}")
    assert remote.exit_code == 0, remote.stderr
    assert remote.stderr.strip().splitlines() == [
        f"warning: sending the admin secret over plain http to http://0.0.0.0:{port}; "
        "use https for anything but a loopback address"
    ]
    local = cli("admin", "mint-api-key", "warned-org", "--api-url", local_server.url)
    assert local.exit_code == 0 and local.stderr == ""
