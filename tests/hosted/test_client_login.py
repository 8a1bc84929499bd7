"""``kvcdn login`` against the real ``oidc-provider`` issuer: the device flow (approved in a
scripted browser), the authorization-code + PKCE fallback, refresh before expiry, logout; the
session is then used against a real ``kvcdn serve`` that verifies the issuer's JWTs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support import services
from tests.support.budget import budget
from tests.support.hosted_client import kvcdn_cmd, kvcdn_login_browser, kvcdn_login_device


@pytest.fixture(scope="module")
def issuer(oidc_issuer):  # the session issuer of tests/hosted/conftest.py
    return oidc_issuer


@pytest.fixture(scope="module")
def server(issuer, tmp_path_factory):
    """A server with the default JWT leeway: the refresh test's access tokens live only 1 s."""
    with services.kvcdn_server(tmp_path_factory.mktemp("serve-login"), env={"KVCDN_ISSUER_URL": issuer.url}) as running:
        yield running


@pytest.fixture
def env(tmp_path, issuer, server):
    """The environment of one user's shell: own config dir, the endpoint and issuer, no telemetry."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCDN_")}
    return {
        **base,
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "KVCDN_API_URL": server.url,
        "KVCDN_ISSUER_URL": issuer.url,
        "KVCDN_TELEMETRY": "0",
    }


def kvcdn(env, *args):
    proc = subprocess.run(
        [*kvcdn_cmd(), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=budget(120),
        stdin=subprocess.DEVNULL,
    )
    return proc


def creds(env) -> dict:
    path = Path(env["XDG_CONFIG_HOME"]) / "kvcdn" / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return json.loads(path.read_text())


def test_device_flow_login_refresh_and_logout(env, issuer, server, tmp_path, qwen3_artifact):
    # a session whose access tokens live 1 s: every later command has to refresh it first
    env = {**env, "KVCDN_OIDC_RESOURCE": services.SHORT_RESOURCE}
    login = kvcdn_login_device(env, "alice")
    assert login.returncode == 0, (login.stdout, login.stderr)
    assert "enter the code:" in login.stderr and "/device" in login.stderr  # URL and code always printed
    assert "logged in" in login.stdout
    first = creds(env)["session"]
    assert first["issuer"] == issuer.url and first["refresh_token"]

    who = kvcdn(env, "whoami", "--format", "json")
    assert who.returncode == 0, who.stderr
    info = json.loads(who.stdout)
    assert info["method"] == "oidc" and info["subject"] == "alice" and info["customer_id"].startswith("oidc:")
    refreshed = creds(env)["session"]
    assert refreshed["access_token"] != first["access_token"]  # refreshed before use
    assert info["access_token"] == refreshed["access_token"]
    # the curl recipe: the JSON form's access_token is a bearer token the API accepts
    direct = httpx.get(f"{server.url}/api/v1/whoami", headers={"Authorization": f"Bearer {info['access_token']}"})
    assert direct.status_code == 200 and direct.json()["subject"] == "alice"
    table = kvcdn(env, "whoami")
    assert table.returncode == 0 and "oidc" in table.stdout and info["access_token"] not in table.stdout

    # the logged-in user can work with artifacts as their own tenant
    up = kvcdn(env, "upload", qwen3_artifact, "--name", "alice-doc", "--quiet")
    assert up.returncode == 0, up.stderr
    listed = kvcdn(env, "list", "--format", "ids")
    assert listed.stdout.split() == [up.stdout.strip()]
    assert kvcdn(env, "delete", up.stdout.strip(), "--yes").returncode == 0

    old_refresh = creds(env)["session"]["refresh_token"]
    out = kvcdn(env, "logout")
    assert out.returncode == 0 and "logged out" in out.stdout
    assert not (Path(env["XDG_CONFIG_HOME"]) / "kvcdn" / "credentials.json").exists()
    after = kvcdn(env, "whoami")
    assert after.returncode == 2 and "kvcdn login" in after.stderr and "Traceback" not in after.stderr
    # logout revoked the refresh token at the issuer
    reuse = httpx.post(
        f"{issuer.url}/token",
        data={"grant_type": "refresh_token", "refresh_token": old_refresh, "client_id": services.CLIENT_ID},
    )
    assert reuse.status_code == 400 and reuse.json()["error"] == "invalid_grant"


def test_api_key_wins_over_login_and_tenants_differ(env, server):
    login = kvcdn_login_device(env, "bob")
    assert login.returncode == 0, login.stderr
    bob = json.loads(kvcdn(env, "whoami", "--format", "json").stdout)
    assert bob["method"] == "oidc" and bob["subject"] == "bob"
    key = kvcdn({**env, "KVCDN_ADMIN_SECRET": server.admin_secret()}, "admin", "mint-api-key", "client-bobs-org")
    assert key.returncode == 0, key.stderr
    assert kvcdn(env, "api-key", "set", key.stdout.strip()).returncode == 0
    who = json.loads(kvcdn(env, "whoami", "--format", "json").stdout)
    assert who["method"] == "api_key" and who["org"] == "client-bobs-org" and who["customer_id"] != bob["customer_id"]
    assert kvcdn(env, "api-key", "clear").returncode == 0
    assert json.loads(kvcdn(env, "whoami", "--format", "json").stdout)["subject"] == "bob"


def test_browser_flow_with_pkce(env, issuer):
    login = kvcdn_login_browser(env, "alice", args=["--timeout", "60"])
    assert login.returncode == 0, (login.stdout, login.stderr)
    assert "code_challenge_method=S256" in login.stderr and "state=" in login.stderr
    session = creds(env)["session"]
    assert session["refresh_token"]
    who = kvcdn(env, "whoami", "--format", "json")
    assert who.returncode == 0 and json.loads(who.stdout)["subject"] == "alice"


def test_login_without_issuer_says_how(env):
    env = {k: v for k, v in env.items() if k != "KVCDN_ISSUER_URL"}
    out = kvcdn(env, "login", "--no-browser")
    assert out.returncode == 2 and "KVCDN_ISSUER_URL" in out.stderr
