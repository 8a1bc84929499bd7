"""Issue 26, item 3: nothing the server answers is built from the request's ``Host`` or
``X-Forwarded-*`` headers, and proxy headers are trusted only from the addresses the operator names
(``--forwarded-allow-ips``; none by default, not even loopback).

Real HTTP against ``kvcdn serve``: a client (or a proxy that passes headers through) can send any
``Host`` and ``X-Forwarded-*`` it likes."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import httpx
import pytest

from tests.support import hosted, services
from tests.support.hosted import API, bearer, request_upload

EVIL = "evil.example"
FORWARDED_FOR = "203.0.113.7"
HOSTILE = {
    "Host": EVIL,
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Host": EVIL,
    "X-Forwarded-For": FORWARDED_FOR,
    "Forwarded": f"for={FORWARDED_FOR};host={EVIL};proto=https",
}


def _no_evil(response: httpx.Response) -> None:
    assert EVIL not in response.text, response.text
    assert not [v for v in response.headers.values() if EVIL in v], dict(response.headers)


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/health/"),
        ("GET", f"{API}/artifacts/"),
        ("GET", f"{API}/quota/"),
        ("POST", f"{API}/artifacts/upload-url/"),
    ],
)
def test_a_trailing_slash_is_not_redirected_to_the_request_host(local_server, org_key, method, path):
    headers = {**HOSTILE, **bearer(org_key("origin"))}
    r = httpx.request(
        method, local_server.url + path, headers=headers, json={} if method == "POST" else None, follow_redirects=False
    )
    assert r.status_code == 404 and r.json()["error"] == "not_found", (r.status_code, r.headers, r.text)
    assert "location" not in r.headers
    _no_evil(r)


def test_signed_urls_name_the_configured_public_url_whatever_the_host(local_server, org_key, small_kv):
    key = org_key("origin")
    with pytest.MonkeyPatch.context() as mp:
        # request_upload posts with httpx.post: add the hostile headers to every call it makes
        original = httpx.post
        mp.setattr(httpx, "post", lambda *a, headers=None, **k: original(*a, headers={**HOSTILE, **headers}, **k))
        r = request_upload(local_server.url, key, small_kv)
    assert r.status_code == 200, r.text
    _no_evil(r)
    plan = r.json()
    assert plan["url"].startswith(local_server.url + "/"), plan["url"]
    hosted.put_bytes(plan, small_kv.read_bytes())
    done = httpx.post(
        f"{local_server.url}{API}/artifacts/{plan['artifact_id']}/confirm-upload",
        json={},
        headers={**HOSTILE, **bearer(key)},
    )
    assert done.status_code == 200, done.text
    _no_evil(done)
    d = httpx.post(
        f"{local_server.url}{API}/artifacts/{plan['artifact_id']}/download-url", headers={**HOSTILE, **bearer(key)}
    )
    assert d.status_code == 200 and d.json()["download_url"].startswith(local_server.url + "/"), d.text
    _no_evil(d)


def _access_line(server: services.KvcdnServer, path: str) -> str:
    """The access-log line of the one request to ``path`` (the log is read as the server writes it)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = [line for line in list(server.log) if f" {path} " in line]
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"no access-log line for {path}:\n" + "".join(server.log[-20:]))


def _probe(server: services.KvcdnServer) -> str:
    path = f"/probe-{uuid.uuid4().hex}"
    r = httpx.get(server.url + path, headers=HOSTILE)
    assert r.status_code == 404
    _no_evil(r)
    return _access_line(server, path)


def test_forwarded_headers_from_loopback_are_not_trusted_by_default(local_server):
    line = _probe(local_server)
    assert "127.0.0.1:" in line and FORWARDED_FOR not in line, line


def test_forwarded_headers_are_trusted_from_the_configured_proxy_only(tmp_path, small_kv):
    with services.kvcdn_server(tmp_path / "trusting", ["--forwarded-allow-ips", "127.0.0.1"]) as server:
        line = _probe(server)
        assert f"{FORWARDED_FOR}:" in line, line  # the client address the proxy reported
        # Even behind a trusted proxy, URLs come from the configured public URL, never the headers.
        key = hosted.mint_key(server.url, server.admin_secret(), "proxied")
        r = httpx.post(
            f"{server.url}{API}/artifacts/upload-url",
            json={"name": "x.kv", "size_bytes": small_kv.stat().st_size, "sha256": hosted.sha256_of(small_kv)},
            headers={**HOSTILE, **bearer(key)},
        )
        assert r.status_code == 200 and r.json()["url"].startswith(server.url + "/"), r.text
        _no_evil(r)


def test_a_bad_forwarded_allow_ips_is_one_line(tmp_path):
    result = subprocess.run(
        [*services.kvcdn_executable(), "serve", "--port", "0", "--forwarded-allow-ips", "10.0.0.0/33"],
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "forwarded-allow-ips" in result.stderr and "Traceback" not in result.stderr, result.stderr
