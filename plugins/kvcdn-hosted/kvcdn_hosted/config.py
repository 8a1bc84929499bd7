"""Client settings: flag → ``KVCDN_*`` environment → ``config.toml`` → defaults.

There is deliberately no built-in production endpoint: a hosted command without an ``api_url``
explains how to set one instead of silently talking to someone's server.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

from kvcdn_core import KvcdnError, config_home, warn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

#: setting → environment variable; every setting may also appear in config.toml under its name.
ENV = {
    "api_url": "KVCDN_API_URL",
    "issuer_url": "KVCDN_ISSUER_URL",
    "client_id": "KVCDN_CLIENT_ID",
    "default_org": "KVCDN_DEFAULT_ORG",
    "default_project": "KVCDN_DEFAULT_PROJECT",
    "api_key": "KVCDN_API_KEY",
    # for identity providers that need them (an API scope, a resource indicator for JWT access tokens)
    "oidc_scope": "KVCDN_OIDC_SCOPE",
    "oidc_resource": "KVCDN_OIDC_RESOURCE",
}
DEFAULTS = {"client_id": "kvcdn-cli", "oidc_scope": "openid offline_access"}


def config_path() -> Path:
    """``$XDG_CONFIG_HOME/kvcdn/config.toml`` (``~/.config/kvcdn/config.toml``)."""
    return config_home() / "config.toml"


@dataclasses.dataclass
class Settings:
    api_url: str | None = None
    issuer_url: str | None = None
    client_id: str = "kvcdn-cli"
    default_org: str | None = None
    default_project: str | None = None
    api_key: str | None = None
    oidc_scope: str = "openid offline_access"
    oidc_resource: str | None = None
    #: setting → where its value came from: flag, env KVCDN_..., config <path>, default
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def require_api_url(self) -> str:
        if not self.api_url:
            raise KvcdnError(
                "no hosted endpoint configured: pass --api-url URL, set KVCDN_API_URL, or add "
                f'api_url = "https://..." to {config_path()} (for a local server: kvcdn serve, '
                "then KVCDN_API_URL=http://127.0.0.1:8080)"
            )
        return self.api_url

    def require_issuer_url(self) -> str:
        if not self.issuer_url:
            raise KvcdnError(
                "no OIDC issuer configured: pass --issuer-url URL, set KVCDN_ISSUER_URL, or add "
                f'issuer_url = "https://..." to {config_path()}; or use an API key: kvcdn api-key set KEY'
            )
        return self.issuer_url


_WARNED: set[tuple[str, str]] = set()


def read_config_file(path: Path | None = None) -> dict[str, str]:
    """The settings of ``config.toml``; a missing file is empty, a malformed one a one-line error."""
    path = path or config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise KvcdnError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise KvcdnError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None)
        message = str(getattr(exc, "msg", "") or exc)
        if line is None:
            found = re.search(r"at line (\d+)", message)
            line = int(found.group(1)) if found else None
        message = re.sub(r"\s*\(at line \d+, column \d+\)\s*$", "", message)
        where = f" at line {line}" if line else ""
        raise KvcdnError(f"config file {path}: malformed TOML{where}: {message}") from None
    settings = {}
    for key, value in data.items():
        if key not in ENV:
            if (str(path), key) not in _WARNED:  # settings are read more than once per command
                _WARNED.add((str(path), key))
                warn(f"config file {path}: unknown setting '{key}' ignored (known: {', '.join(ENV)})")
            continue
        if not isinstance(value, str):
            raise KvcdnError(f"config file {path}: '{key}' must be a string, got {type(value).__name__}")
        settings[key] = value
    return settings


def load_settings(**flags: str | None) -> Settings:
    """Resolve every setting; ``flags`` are command-line values (``None`` when not given)."""
    unknown = set(flags) - set(ENV)
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}")
    path = config_path()
    from_file = read_config_file(path)
    values: dict[str, str | None] = {}
    sources: dict[str, str] = {}
    for key, env_name in ENV.items():
        candidates = (
            (flags.get(key), "flag"),
            (os.environ.get(env_name), f"env {env_name}"),
            (from_file.get(key), f"config {path}"),
            (DEFAULTS.get(key), "default"),
        )
        for value, source in candidates:
            if value:  # an empty string means "not set", as shells make it easy to export one
                values[key], sources[key] = value.strip(), source
                break
        else:
            values[key] = None
    for key in ("api_url", "issuer_url"):
        if values[key]:
            values[key] = normalize_url(values[key], key)
    return Settings(**values, sources=sources)


def normalize_url(url: str, what: str) -> str:
    if not re.match(r"^https?://[^/\s]+", url):
        raise KvcdnError(f"{what} '{url}' is not an http(s) URL")
    return url.rstrip("/")
