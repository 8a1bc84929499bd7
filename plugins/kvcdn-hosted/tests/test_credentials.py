"""Credentials: private (0600), atomic, and removable; an API key beats a login session."""

import json
import os
import stat

import pytest

from kvcdn_core.errors import KvcdnError
from kvcdn_hosted import credentials
from kvcdn_hosted.client import resolve_credential
from kvcdn_hosted.config import load_settings

KEY = "kv_" + "ab" * 32
KEY2 = "kv_" + "cd" * 32


def test_saved_private_and_atomically(config_home):
    path = credentials.update(api_key=KEY) and credentials.credentials_path()
    assert path.parent == config_home
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"api_key": KEY}
    credentials.update(session={"issuer": "http://i", "access_token": "t"})
    assert sorted(os.listdir(config_home)) == ["credentials.json"]  # no temp file left behind
    assert credentials.load()["api_key"] == KEY
    credentials.update(api_key=None)
    assert "api_key" not in credentials.load()
    assert credentials.clear() and not path.exists()


def test_widened_mode_is_narrowed(config_home, recwarn):
    credentials.update(api_key=KEY)
    path = credentials.credentials_path()
    os.chmod(path, 0o644)
    assert credentials.load()["api_key"] == KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert any("readable by others" in str(w.message) for w in recwarn)


def test_corrupt_file_is_a_clear_error(config_home):
    config_home.mkdir(parents=True)
    credentials.credentials_path().write_text("{not json")
    credentials.credentials_path().chmod(0o600)  # only the content is wrong
    with pytest.raises(KvcdnError, match="kvcdn logout"):
        credentials.load()


def test_api_key_precedence_over_session(config_home, monkeypatch):
    future = 4_000_000_000
    credentials.update(
        session={"issuer": "http://i", "client_id": "kvcdn-cli", "access_token": "jwt", "expires_at": future}
    )
    c = resolve_credential(load_settings())
    assert (c.method, c.token) == ("oidc", "jwt")
    credentials.update(api_key=KEY)
    c = resolve_credential(load_settings())
    assert (c.method, c.token) == ("api_key", KEY) and c.source.startswith("stored")
    monkeypatch.setenv("KVCDN_API_KEY", KEY2)
    c = resolve_credential(load_settings())
    assert (c.token, c.source) == (KEY2, "env KVCDN_API_KEY")
    c = resolve_credential(load_settings(api_key=KEY.upper().replace("KV_", "kv_")))
    assert (c.token, c.source) == (KEY, "flag")


def test_session_of_another_issuer_is_not_used(config_home, monkeypatch):
    credentials.update(session={"issuer": "http://i", "access_token": "jwt", "expires_at": None})
    monkeypatch.setenv("KVCDN_ISSUER_URL", "http://other")
    assert resolve_credential(load_settings()) is None
