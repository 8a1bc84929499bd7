"""`kvcdn serve` settings: flag → KVCDN_* variable → config file → default, the config file's place
and rules (unknown keys and secrets refused, a database password only in a private file), and bad
values as one line with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcdn_core import KvcdnError
from tests.support import services
from tests.support.budget import budget


@pytest.fixture(autouse=True)
def _no_kvcdn_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVCDN_")]:
        monkeypatch.delenv(name)


def _config(tmp_path, text, mode=0o600):
    path = tmp_path / "server.toml"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_flag_beats_env_beats_file_beats_default(tmp_path, monkeypatch):
    from kvcdn_server.config import load_config

    path = _config(tmp_path, "infer_concurrency = 5\ngc_interval = 7\njwt_leeway = 9\nmodels = ['a', 'b']\n")
    monkeypatch.setenv("KVCDN_INFER_CONCURRENCY", "4")
    monkeypatch.setenv("KVCDN_GC_INTERVAL", "8")
    config = load_config(str(path), infer_concurrency=3)
    assert (config.infer_concurrency, config.sources["infer_concurrency"]) == (3, "flag")
    assert (config.gc_interval, config.sources["gc_interval"]) == (8.0, "env KVCDN_GC_INTERVAL")
    assert (config.jwt_leeway, config.sources["jwt_leeway"]) == (9, f"config {path}")
    assert config.models == ["a", "b"] and config.config_file == path
    assert (config.orphan_grace, config.sources["orphan_grace"]) == (3600.0, "default")
    assert load_config(str(path)).infer_concurrency == 4
    monkeypatch.delenv("KVCDN_INFER_CONCURRENCY")
    assert load_config(str(path)).infer_concurrency == 5
    assert load_config().infer_concurrency == 2  # no --config, and no default file: the default


def test_where_the_config_file_is(tmp_path, monkeypatch):
    from kvcdn_core import config_home
    from kvcdn_server.config import load_config

    default = config_home() / "server.toml"
    default.parent.mkdir(parents=True)
    default.write_text("quota_artifacts = 11\n")
    assert load_config().quota_artifacts == 11
    monkeypatch.setenv("KVCDN_SERVER_CONFIG", str(_config(tmp_path, "quota_artifacts = 12\n")))
    assert load_config().quota_artifacts == 12
    other = tmp_path / "other.toml"
    other.write_text("quota_artifacts = 13\n")
    assert load_config(str(other)).quota_artifacts == 13
    with pytest.raises(KvcdnError, match="config file .*missing.toml does not exist"):
        load_config(str(tmp_path / "missing.toml"))


def test_unknown_keys_and_secrets_are_refused(tmp_path):
    from kvcdn_server.config import load_config

    path = _config(tmp_path, "infer_concurency = 4\n")
    with pytest.raises(KvcdnError) as err:
        load_config(str(path))
    assert (
        str(err.value) == f"config file {path}: unknown setting 'infer_concurency' (did you mean 'infer_concurrency'?)"
    )
    for key, env in (
        ("admin_secret", "KVCDN_ADMIN_SECRET"),
        ("api_key_seed", "KVCDN_API_KEY_SEED"),
        ("url_signing_key", "KVCDN_URL_SIGNING_KEY"),
        ("telemetry_secret", "KVCDN_TELEMETRY_SECRET"),
    ):
        _config(tmp_path, f'{key} = "{"s" * 40}"\n')
        with pytest.raises(KvcdnError) as err:
            load_config(str(path))
        assert (
            str(err.value) == f"config file {path}: '{key}' is a secret and is not read from a config file; set {env}"
        )


def test_a_database_password_only_from_a_private_file(tmp_path):
    from kvcdn_server.config import load_config

    url = "postgresql://kvcdn:hunter2@db.internal/kvcdn"
    path = _config(tmp_path, f'database_url = "{url}"\n', mode=0o644)
    with pytest.raises(KvcdnError, match="holds a password but the file is readable by other users; chmod 600"):
        load_config(str(path))
    os.chmod(path, 0o600)
    assert load_config(str(path)).database_url == url
    _config(tmp_path, 'database_url = "postgresql://kvcdn@db.internal/kvcdn"\n', mode=0o644)
    assert load_config(str(path)).database_url == "postgresql://kvcdn@db.internal/kvcdn"


def test_values_keep_their_meaning_from_every_source(tmp_path, monkeypatch):
    from kvcdn_server.config import load_config

    path = _config(
        tmp_path,
        'api_key_orgs = "acme,beta:2"\njwt_algorithms = ["ES256"]\nforwarded_allow_ips = "10.0.0.0/8, *"\n'
        'issuer_url = "https://id.example.com"\nstorage = "s3://bucket/p"\nhost = "0.0.0.0"\nport = 9000\n'
        'log_level = "debug"\n',
    )
    config = load_config(str(path))
    assert config.env_orgs == {"acme": 1, "beta": 2} and config.jwt_algorithms == ["ES256"]
    assert config.forwarded_allow_ips == ["10.0.0.0/8", "*"] and config.issuer_url == "https://id.example.com"
    assert (config.storage_uri, config.host, config.port, config.log_level) == (
        "s3://bucket/p",
        "0.0.0.0",
        9000,
        "debug",
    )
    monkeypatch.setenv("KVCDN_FORWARDED_ALLOW_IPS", "10.1.0.5")
    assert load_config(str(path)).forwarded_allow_ips == ["10.1.0.5"]
    assert load_config(str(path), forwarded_allow_ips="").forwarded_allow_ips == []  # an empty flag: trust none


@pytest.mark.parametrize(
    "text,env,message",
    [
        ("jwt_leeway = 'soon'\n", {}, "config file {path}: 'jwt_leeway' must be an integer, not 'soon'"),
        ("port = 70000\n", {}, "config file {path}: 'port' must be at most 65535"),
        (
            "infer_device = 'tpu'\n",
            {},
            "config file {path}: 'infer_device' must be one of auto, cpu, cuda, mps, not 'tpu'",
        ),
        (
            "jwt_algorithms = 'HS256'\n",
            {},
            "config file {path}: 'jwt_algorithms' HS256 not allowed (asymmetric algorithms only)",
        ),
        ("api_key_orgs = 'acme:x'\n", {}, "config file {path}: 'api_key_orgs' has a bad generation in 'acme:x'"),
        ("", {"KVCDN_API_KEY_ORGS": "Acme!"}, "KVCDN_API_KEY_ORGS has a bad org slug: org slug 'Acme!' must match"),
        ("", {"KVCDN_GC_INTERVAL": "soon"}, "KVCDN_GC_INTERVAL must be a number, not 'soon'"),
        ("", {"KVCDN_INFER_DEVICE": "tpu"}, "KVCDN_INFER_DEVICE must be one of auto, cpu, cuda, mps, not 'tpu'"),
        ("", {"KVCDN_FORWARDED_ALLOW_IPS": "10.0.0.0/33"}, "KVCDN_FORWARDED_ALLOW_IPS '10.0.0.0/33' is not an IP"),
    ],
)
def test_a_bad_value_names_the_setting_and_its_source(tmp_path, monkeypatch, text, env, message):
    from kvcdn_server.config import load_config

    path = _config(tmp_path, text)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(KvcdnError) as err:
        load_config(str(path))
    assert str(err.value).startswith(message.format(path=path))


@pytest.mark.parametrize(
    "text,message",
    [
        ("gc_interval = -1\n", "'gc_interval' must be positive"),
        ("colour = 'blue'\n", "unknown setting 'colour'"),
        ("admin_secret = 'x'\n", "'admin_secret' is a secret"),
    ],
)
def test_serve_refuses_a_bad_config_file_in_one_line(tmp_path, text, message):
    path = _config(tmp_path, text)
    proc = subprocess.run(
        [sys.executable, "-m", "kvcdn_core", "serve", "--port", "0", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=budget(60),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: config file {path}: " + proc.stderr.split(f"{path}: ", 1)[1].strip()
    ]
    assert message in proc.stderr


def test_serve_reads_its_settings_from_the_config_file(tmp_path):
    path = _config(tmp_path, 'public_url = "https://kv.example.test"\ninfer_device = "cpu"\n')
    with services.kvcdn_server(tmp_path / "data", ["--config", str(path)]) as server:
        pass
    log = "".join(server.log)
    assert f"settings from {path}" in log
    assert "curl -X POST https://kv.example.test/api/v1/admin/api-keys" in log
