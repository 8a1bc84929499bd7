"""Settings resolution: flag → KVCDN_* env → config.toml → defaults; clear errors."""

import pytest

from kvcdn_core.errors import KvcdnError
from kvcdn_hosted import telemetry
from kvcdn_hosted.config import given_in_environment, load_settings, read_config_file


def write_config(config_home, text):
    config_home.mkdir(parents=True, exist_ok=True)
    path = config_home / "config.toml"
    path.write_text(text)
    return path


def test_precedence_flag_env_file_default(config_home, monkeypatch):
    write_config(
        config_home, 'api_url = "http://file:1"\nissuer_url = "http://issuer-file"\ndefault_org = "file-org"\n'
    )
    monkeypatch.setenv("KVCDN_API_URL", "http://env:2")
    s = load_settings(api_url="http://flag:3/")
    assert s.api_url == "http://flag:3" and s.sources["api_url"] == "flag"
    s = load_settings()
    assert s.api_url == "http://env:2" and s.sources["api_url"] == "env KVCDN_API_URL"
    assert s.issuer_url == "http://issuer-file" and s.sources["issuer_url"].startswith("config ")
    assert s.default_org == "file-org"
    assert s.client_id == "kvcdn-cli" and s.sources["client_id"] == "default"
    monkeypatch.setenv("KVCDN_CLIENT_ID", "other-client")
    assert load_settings().client_id == "other-client"


def test_no_builtin_endpoint_says_how_to_set_one(config_home):
    s = load_settings()
    assert s.api_url is None
    with pytest.raises(KvcdnError) as err:
        s.require_api_url()
    assert "KVCDN_API_URL" in str(err.value) and "config.toml" in str(err.value)


def test_malformed_toml_names_file_and_line(config_home):
    path = write_config(config_home, 'api_url = "http://x"\nclient_id = \n')
    with pytest.raises(KvcdnError) as err:
        load_settings()
    message = str(err.value)
    assert str(path) in message and "line 2" in message and "\n" not in message


def test_wrong_type_and_unknown_key(config_home):
    path = write_config(config_home, "api_url = 3\n")
    with pytest.raises(KvcdnError, match="'api_url' must be a string"):
        load_settings()
    write_config(config_home, 'api_url = "http://ok"\napi_ur = "http://typo"\n')
    with pytest.raises(KvcdnError) as err:
        read_config_file(path)
    assert str(err.value) == f"config file {path}: unknown setting 'api_ur' (did you mean 'api_url'?)"


def test_url_must_be_http(config_home):
    with pytest.raises(KvcdnError, match="^--api-url must be an http"):
        load_settings(api_url="ftp://x")
    with pytest.raises(KvcdnError, match="^KVCDN_ISSUER_URL must be an http"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("KVCDN_ISSUER_URL", "issuer.example.com")
            load_settings()


@pytest.mark.parametrize(("value", "on"), [("0", False), (" 0 ", False), ("1", True), ("false", True), ("", True)])
def test_telemetry_is_off_only_for_0(config_home, monkeypatch, value, on):
    """KVCDN_TELEMETRY is opt-out: only `0` turns it off (`false` too leaves it on; empty is unset)."""
    monkeypatch.setenv("KVCDN_TELEMETRY", value)
    s = load_settings(api_url="http://x")
    assert s.telemetry is on and telemetry.enabled(s) is on
    assert not telemetry.enabled(load_settings())  # never without an endpoint


def test_telemetry_in_the_config_file(config_home, monkeypatch):
    write_config(config_home, 'telemetry = "0"\n')
    assert load_settings().telemetry is False
    monkeypatch.setenv("KVCDN_TELEMETRY", "1")
    assert load_settings().telemetry is True  # the variable beats the file
    monkeypatch.delenv("KVCDN_TELEMETRY")
    write_config(config_home, "telemetry = false\n")
    with pytest.raises(KvcdnError, match="'telemetry' must be a string"):
        load_settings()


def test_admin_secret_comes_from_the_environment_only(config_home, monkeypatch):
    assert load_settings().admin_secret is None
    monkeypatch.setenv("KVCDN_ADMIN_SECRET", "  s3cret-of-the-server  ")
    s = load_settings()
    assert s.admin_secret == "s3cret-of-the-server" and "s3cret" not in repr(s)
    monkeypatch.setenv("KVCDN_ADMIN_SECRET", " ")
    assert load_settings().admin_secret is None  # empty is unset
    write_config(config_home, 'admin_secret = "in-a-file"\n')
    with pytest.raises(KvcdnError, match="'admin_secret' is a secret and is not read from a config file"):
        load_settings()


def test_an_api_key_given_in_the_environment_is_seen_even_past_a_broken_file(config_home, monkeypatch):
    write_config(config_home, 'api_key = "kv_from_the_file"\n')
    assert not given_in_environment("api_key")
    monkeypatch.setenv("KVCDN_API_KEY", "kv_from_the_environment")
    write_config(config_home, "api_key = \n")  # malformed: logout's note does not read it
    assert given_in_environment("api_key")
