"""Client settings: flag → ``KVCDN_*`` environment → ``config.toml`` → defaults.

There is deliberately no built-in production endpoint: a hosted command without an ``api_url``
explains how to set one instead of silently talking to someone's server.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from kvcdn_core import KvcdnError, config_home, settings


def _url(raw: Any) -> str:
    url = settings.text(raw)
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError(f"must be an http(s) URL, not '{url}'")
    return url.rstrip("/")


def _optional(raw: Any) -> str | None:
    return settings.text(raw) or None


def _telemetry(raw: Any) -> bool:
    """Opt-out: only ``0`` turns it off; any other string (``false`` too) leaves it on."""
    return settings.text(raw) != "0"


#: Every client setting; the config-file key is the name, the variable ``KVCDN_`` and the name in capitals.
SETTINGS: tuple[settings.Setting, ...] = (
    settings.Setting(
        "api_url",
        "The hosted endpoint every hosted command talks to.",
        _url,
        env="KVCDN_API_URL",
        flag="--api-url",
        default_doc="none: there is no built-in production endpoint",
    ),
    settings.Setting(
        "issuer_url",
        "The OIDC issuer `kvcdn login` signs in with.",
        _url,
        env="KVCDN_ISSUER_URL",
        flag="--issuer-url",
    ),
    settings.Setting(
        "client_id",
        "The OIDC client id of `kvcdn login`.",
        default="kvcdn-cli",
        env="KVCDN_CLIENT_ID",
        flag="--client-id",
    ),
    settings.Setting(
        "default_org",
        "The org `kvcdn infer` names to older servers.",
        _optional,
        env="KVCDN_DEFAULT_ORG",
        flag="--org",
    ),
    settings.Setting(
        "default_project",
        "The project `kvcdn infer` names to older servers.",
        _optional,
        env="KVCDN_DEFAULT_PROJECT",
        flag="--project",
    ),
    settings.Setting(
        "api_key",
        "An org API key (`kv_...`); it wins over a login session.",
        _optional,
        env="KVCDN_API_KEY",
        flag="--api-key",
        default_doc="none (see credentials)",
    ),
    settings.Setting(
        "oidc_scope",
        "The scopes `kvcdn login` asks for (some identity providers need an API scope).",
        default="openid offline_access",
        env="KVCDN_OIDC_SCOPE",
    ),
    settings.Setting(
        "oidc_resource",
        "A resource indicator `kvcdn login` sends, for issuers that issue JWT access tokens per resource.",
        _optional,
        env="KVCDN_OIDC_RESOURCE",
    ),
    settings.Setting(
        "telemetry",
        "One anonymous event per hosted command (see Telemetry): `0` turns it off; any other value leaves it on.",
        _telemetry,
        default=True,
        env="KVCDN_TELEMETRY",
        default_doc="on",
    ),
    settings.Setting(
        "admin_secret",
        "The server's admin secret, which `kvcdn admin mint-api-key` sends.",
        _optional,
        env="KVCDN_ADMIN_SECRET",
        file=False,
    ),
)
NAMES = tuple(s.name for s in SETTINGS)


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
    telemetry: bool = True
    admin_secret: str | None = dataclasses.field(default=None, repr=False)
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


def read_config_file(path: Path | None = None) -> dict[str, Any]:
    """The settings of ``config.toml``; a missing file is empty; a malformed one, an unknown key or a
    value of the wrong type is a one-line error."""
    return settings.read_config_file(path or config_path(), SETTINGS)


def given_in_environment(name: str) -> bool:
    """Whether setting ``name`` is given by its environment variable (it beats the config file, so
    the file is not read: a broken one does not hide it)."""
    (setting,) = (s for s in SETTINGS if s.name == name)
    return settings.resolve([setting])[1][name] != "default"


def load_settings(**flags: str | None) -> Settings:
    """Resolve every setting; ``flags`` are command-line values (``None`` when not given)."""
    path = config_path()
    values, sources = settings.resolve(SETTINGS, flags, read_config_file(path), path)
    return Settings(**values, sources=sources)
