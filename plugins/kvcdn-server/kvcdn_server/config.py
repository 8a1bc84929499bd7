"""Server settings: the table :data:`SETTINGS`, resolved flag → ``KVCDN_*`` variable → config file
(``--config PATH``, ``KVCDN_SERVER_CONFIG``, or ``$XDG_CONFIG_HOME/kvcdn/server.toml``) → default,
and the secrets created on first start.

Secrets (API-key seed, admin secret, URL-signing key, telemetry secret) are never read from the
config file: they come from the environment when set, which is how several replicas share them;
otherwise the first three are 0600 files under the server's data directory, created with 32 random
bytes on first start. A database URL with a password is read from a config file only when the file
is private (no access for group or others).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
from pathlib import Path
from typing import Any

from kvcdn_core import KvcdnError, config_home, data_home, settings

GIB = 1 << 30
#: secrets given through the environment are at least this long
MIN_SECRET = 32
ALLOWED_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
#: compute dtypes the server may be told to use (auto: float32 on CPU, bfloat16 on CUDA)
INFER_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: where ``--config`` points when given by environment
CONFIG_ENV = "KVCDN_SERVER_CONFIG"


def server_home() -> Path:
    """``$XDG_DATA_HOME/kvcdn/server``."""
    return data_home() / "server"


@dataclasses.dataclass
class ServerConfig:
    """Everything the app needs; built by :func:`load_config` from :data:`SETTINGS`."""

    home: Path
    storage_uri: str
    database_url: str
    models: list[str]
    public_url: str | None
    issuer_url: str | None
    client_id: str
    jwt_algorithms: list[str]
    jwt_leeway: int
    api_key_seed: bytes
    admin_secret: str
    url_key: bytes
    env_orgs: dict[str, int]
    quota_artifacts: int
    quota_bytes: int
    max_artifact_bytes: int
    upload_ttl: int
    download_ttl: int
    pending_grace: int
    lease_seconds: float
    orphan_grace: float
    gc_interval: float
    orgs_refresh: float
    infer_concurrency: int
    infer_timeout: float
    infer_max_models: int
    infer_cache_bytes: int
    infer_device: str
    infer_dtype: str
    infer_per_tenant: int
    infer_max_new_tokens: int
    infer_max_question_tokens: int
    infer_max_question_bytes: int
    infer_max_context_tokens: int
    infer_model_bytes: int
    telemetry_url: str | None
    telemetry_secret: str | None
    created_secrets: list[Path] = dataclasses.field(default_factory=list)
    #: a vLLM server that answers ``infer`` on one artifact (None: the in-process engine)
    infer_engine: str | None = None
    #: addresses (IPs or networks) whose X-Forwarded-For/-Proto are believed; none by default
    forwarded_allow_ips: list[str] = dataclasses.field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"
    #: the config file read (``None``: none was there)
    config_file: Path | None = None
    #: setting → where its value came from: flag, env KVCDN_..., config <path>, default
    sources: dict[str, str] = dataclasses.field(default_factory=dict)


def _secret_file(path: Path, created: list[Path]) -> bytes:
    """Read a 0600 secret file, creating it (atomically, never readable by others) when missing."""
    try:
        text = path.read_text().strip()
        if path.stat().st_mode & 0o077:
            raise KvcdnError(f"{path} is readable by other users; chmod 600 it")
        if not text:
            raise KvcdnError(f"{path} is empty; delete it to create a new secret")
        return text.encode()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_hex(32)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(value + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # never replaces a secret another process created meanwhile
            created.append(path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip().encode()


def parse_orgs(raw: Any) -> dict[str, int]:
    """``acme,beta:2`` → ``{"acme": 1, "beta": 2}`` (``:N`` is the key generation after rotations)."""
    from kvcdn_server.apikeys import check_slug

    orgs = {}
    for item in settings.comma_list(raw):
        slug, _, gen = item.partition(":")
        try:
            check_slug(slug)
        except ValueError as exc:
            raise ValueError(f"has a bad org slug: {exc}") from None
        try:
            orgs[slug] = int(gen) if gen else 1
        except ValueError:
            raise ValueError(f"has a bad generation in '{item}'") from None
    return orgs


def check_issuer_url(url: str | None) -> str | None:
    """An issuer must be https, or http on a loopback address (tests, local development)."""
    if not url:
        return None
    from urllib.parse import urlparse

    parsed = urlparse(url)
    loopback = parsed.hostname in ("127.0.0.1", "localhost", "::1")
    if parsed.scheme != "https" and not (parsed.scheme == "http" and loopback):
        raise KvcdnError(f"issuer URL '{url}' must use https (plain http only on a loopback address)")
    return url  # exactly as given: tokens' ``iss`` must equal what the issuer's discovery states


def _issuer(raw: Any) -> str | None:
    try:
        return check_issuer_url(settings.text(raw))
    except KvcdnError:
        raise ValueError(f"must use https (plain http only on a loopback address), not '{raw}'") from None


def parse_forwarded_allow_ips(raw: Any) -> list[str]:
    """``10.0.0.5,10.1.0.0/16`` → the proxies whose forwarded headers are believed (``*``: any)."""
    import ipaddress

    allowed = settings.comma_list(raw)
    for item in allowed:
        if item == "*":
            continue
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ValueError(f"'{item}' is not an IP address or network") from None
    return allowed


def _algorithms(raw: Any) -> list[str]:
    algorithms = settings.comma_list(raw)
    bad = [a for a in algorithms if a not in ALLOWED_ALGORITHMS]
    if bad:
        raise ValueError(f"{', '.join(bad)} not allowed (asymmetric algorithms only)")
    return algorithms


def _secret_value(raw: Any) -> str:
    value = settings.text(raw)
    if len(value) < MIN_SECRET:
        raise ValueError(f"is too short: use at least {MIN_SECRET} characters (32 random bytes in hex is best)")
    return value


def _optional_text(raw: Any) -> str | None:
    return settings.text(raw) or None


def _engine_url(raw: Any) -> str | None:
    value = settings.text(raw)
    if value and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
        raise ValueError("is not an http:// or https:// base URL (of a vLLM OpenAI-compatible server)")
    return value.rstrip("/") or None


_integer = settings.integer
_number = settings.positive_number
_GIB_DOC = "`{}` ({} GiB)"

#: Every setting of ``kvcdn serve``, in the order the docs list them. The config-file key is the name;
#: the environment variable is ``KVCDN_`` and the name in capitals (a few have none, a few no flag).
SETTINGS: tuple[settings.Setting, ...] = (
    settings.Setting(
        "host",
        "Address to bind; the default is loopback only (put TLS and a load balancer in front otherwise).",
        default="127.0.0.1",
        flag="--host",
    ),
    settings.Setting("port", "TCP port to listen on (0: any free port).", _integer(0, 65535), 8080, flag="--port"),
    settings.Setting(
        "log_level",
        "Least severe server log lines shown on stderr (requests are logged at info).",
        settings.choice(*LOG_LEVELS),
        "info",
        flag="--log-level",
    ),
    settings.Setting(
        "storage",
        "Where artifacts live: a directory (server-signed blob URLs), `s3://bucket/prefix` (presigned S3 URLs, multipart above `KVCDN_S3_PART_SIZE`), or the URI of any installed storage plugin that stores any bytes and renames (its presigned URLs when it has them, else server-signed blob URLs; multipart when it declares the capability).",
        _optional_text,
        env="KVCDN_STORAGE",
        flag="--storage",
        default_doc="`$XDG_DATA_HOME/kvcdn/server/objects`",
    ),
    settings.Setting(
        "database_url",
        "Where all state lives: an SQLite file, or `postgresql://user:password@host/db` for several replicas; migrated on start.",
        _optional_text,
        env="KVCDN_DATABASE_URL",
        flag="--database",
        default_doc="`sqlite:///$XDG_DATA_HOME/kvcdn/server/kvcdn.db`",
    ),
    settings.Setting(
        "models",
        "Model ids (from the local hub cache) or directories inference may load, and the only ones (comma-separated).",
        settings.comma_list,
        [],
        env="KVCDN_MODELS",
        flag="--models",
    ),
    settings.Setting(
        "public_url",
        "External base URL of signed links, e.g. `https://kv.example.com` (the `Host` header is never used).",
        _optional_text,
        env="KVCDN_PUBLIC_URL",
        flag="--public-url",
        default_doc="the address it listens on",
    ),
    settings.Setting(
        "issuer_url",
        "OIDC issuer whose access tokens are accepted; https, or http on a loopback address.",
        _issuer,
        env="KVCDN_ISSUER_URL",
        flag="--issuer-url",
        default_doc="none (API keys only)",
    ),
    settings.Setting(
        "client_id",
        "Audience (`aud`) required in access tokens.",
        default="kvcdn-cli",
        env="KVCDN_CLIENT_ID",
        flag="--client-id",
    ),
    settings.Setting(
        "jwt_algorithms",
        "Signature algorithms accepted in access tokens (asymmetric only).",
        _algorithms,
        ["RS256", "PS256", "ES256"],
        env="KVCDN_JWT_ALGORITHMS",
        default_doc="`RS256,PS256,ES256`",
    ),
    settings.Setting(
        "jwt_leeway",
        "Clock leeway in seconds when checking tokens' `exp` and `nbf`.",
        _integer(0),
        30,
        env="KVCDN_JWT_LEEWAY",
    ),
    settings.Setting(
        "api_key_seed",
        "Org API keys are derived from it: at least 32 characters, the same on every replica.",
        _secret_value,
        env="KVCDN_API_KEY_SEED",
        file=False,
        default_doc="0600 file `api-key-seed`, created on first start",
    ),
    settings.Setting(
        "admin_secret",
        "The `X-Kvcdn-Admin-Secret` of the admin routes: at least 32 characters, the same on every replica.",
        _secret_value,
        env="KVCDN_ADMIN_SECRET",
        file=False,
        default_doc="0600 file `admin-secret`, created on first start",
    ),
    settings.Setting(
        "url_signing_key",
        "Signs server-signed blob URLs: at least 32 characters, the same on every replica.",
        _secret_value,
        env="KVCDN_URL_SIGNING_KEY",
        file=False,
        default_doc="0600 file `url-signing-key`, created on first start",
    ),
    settings.Setting(
        "api_key_orgs",
        "Orgs known without the admin route: `acme,beta:2` (`:N` is the key generation).",
        parse_orgs,
        {},
        env="KVCDN_API_KEY_ORGS",
        default_doc="none",
    ),
    settings.Setting("quota_artifacts", "Artifacts per tenant.", _integer(0), 1000, env="KVCDN_QUOTA_ARTIFACTS"),
    settings.Setting(
        "quota_storage_bytes",
        "Stored bytes per tenant.",
        _integer(0),
        10 * GIB,
        env="KVCDN_QUOTA_STORAGE_BYTES",
        default_doc=_GIB_DOC.format(10 * GIB, 10),
    ),
    settings.Setting(
        "max_artifact_bytes",
        "Largest `size_bytes` of one upload.",
        _integer(1),
        50 * GIB,
        env="KVCDN_MAX_ARTIFACT_BYTES",
        default_doc=_GIB_DOC.format(50 * GIB, 50),
    ),
    settings.Setting(
        "upload_url_ttl", "Lifetime of a signed upload URL, in seconds.", _integer(1), 3600, env="KVCDN_UPLOAD_URL_TTL"
    ),
    settings.Setting(
        "download_url_ttl",
        "Lifetime of a signed download URL, in seconds.",
        _integer(1),
        3600,
        env="KVCDN_DOWNLOAD_URL_TTL",
    ),
    settings.Setting(
        "pending_grace",
        "Seconds after the upload URL's expiry before an open upload expires.",
        _integer(0),
        900,
        env="KVCDN_PENDING_GRACE",
    ),
    settings.Setting(
        "lease_seconds",
        "Lease of a running PUT or confirm, in seconds; after it runs out unrenewed, the upload fails.",
        _number,
        30.0,
        env="KVCDN_LEASE_SECONDS",
        default_doc="`30`",
    ),
    settings.Setting(
        "orphan_grace",
        "Age in seconds after which objects and temp files the database does not hold live are deleted.",
        _number,
        3600.0,
        env="KVCDN_ORPHAN_GRACE",
        default_doc="`3600`",
    ),
    settings.Setting(
        "gc_interval",
        "Seconds between garbage collections (each replica).",
        _number,
        60.0,
        env="KVCDN_GC_INTERVAL",
        default_doc="`60`",
    ),
    settings.Setting(
        "orgs_refresh",
        "Seconds between re-reads of the orgs and their key generations from the database (each replica).",
        _number,
        5.0,
        env="KVCDN_ORGS_REFRESH",
        default_doc="`5`",
    ),
    settings.Setting(
        "infer_concurrency",
        "Inference requests run at once; more get `429`.",
        _integer(1),
        2,
        env="KVCDN_INFER_CONCURRENCY",
        flag="--infer-concurrency",
    ),
    settings.Setting(
        "infer_timeout",
        "Seconds before an inference request gets `504`.",
        _number,
        120.0,
        env="KVCDN_INFER_TIMEOUT",
        flag="--infer-timeout",
        default_doc="`120`",
    ),
    settings.Setting(
        "infer_max_models",
        "Models kept loaded (least recently used goes first).",
        _integer(1),
        2,
        env="KVCDN_INFER_MAX_MODELS",
    ),
    settings.Setting(
        "infer_cache_bytes",
        "Bytes of artifact caches kept loaded (least recently used goes first).",
        _integer(1),
        4 * GIB,
        env="KVCDN_INFER_CACHE_BYTES",
        default_doc=_GIB_DOC.format(4 * GIB, 4),
    ),
    settings.Setting(
        "infer_device",
        "Where inference runs: `auto`, `cpu`, `cuda` or `mps`.",
        settings.choice("auto", "cpu", "cuda", "mps"),
        "auto",
        env="KVCDN_INFER_DEVICE",
        flag="--device",
    ),
    settings.Setting(
        "infer_dtype",
        "The compute dtype of inference (`auto`: float32 on CPU, bfloat16 on CUDA), the `--infer-engine` server's too; artifacts computed in another are refused.",
        settings.choice(*INFER_DTYPES),
        "auto",
        env="KVCDN_INFER_DTYPE",
        flag="--infer-dtype",
    ),
    settings.Setting(
        "infer_per_tenant",
        "Inference slots one tenant may hold at once (0: `ceil(infer_concurrency / 2)`).",
        _integer(0),
        0,
        env="KVCDN_INFER_PER_TENANT",
    ),
    settings.Setting(
        "infer_max_new_tokens",
        "Largest `n` of one inference request.",
        _integer(1),
        256,
        env="KVCDN_INFER_MAX_NEW_TOKENS",
    ),
    settings.Setting(
        "infer_max_question_tokens",
        "Longest question, in tokens.",
        _integer(1),
        1024,
        env="KVCDN_INFER_MAX_QUESTION_TOKENS",
    ),
    settings.Setting(
        "infer_max_question_bytes",
        "Longest question in UTF-8 bytes, checked before any slot, artifact or model (0: 16 × `infer_max_question_tokens`).",
        _integer(0),
        0,
        env="KVCDN_INFER_MAX_QUESTION_BYTES",
    ),
    settings.Setting(
        "infer_max_context_tokens",
        "Longest artifact context inference accepts, in tokens.",
        _integer(1),
        32768,
        env="KVCDN_INFER_MAX_CONTEXT_TOKENS",
    ),
    settings.Setting(
        "infer_model_bytes",
        "Largest model (weights on disk) inference loads.",
        _integer(1),
        16 * GIB,
        env="KVCDN_INFER_MODEL_BYTES",
        default_doc=_GIB_DOC.format(16 * GIB, 16),
    ),
    settings.Setting(
        "infer_engine",
        "Base URL of a vLLM OpenAI-compatible server with the kvcdn connector that answers `infer` on one chunked artifact (limits, slots and cancellation stay here; see docs/vllm.md).",
        _engine_url,
        env="KVCDN_INFER_ENGINE",
        flag="--infer-engine",
        default_doc="none: the in-process engine",
    ),
    settings.Setting(
        "telemetry_url",
        "Where clients' telemetry events are forwarded (without it they are logged as JSON lines).",
        _optional_text,
        env="KVCDN_TELEMETRY_URL",
    ),
    settings.Setting(
        "telemetry_secret",
        "Sent as `Authorization: Bearer` with forwarded telemetry.",
        _optional_text,
        env="KVCDN_TELEMETRY_SECRET",
        file=False,
    ),
    settings.Setting(
        "forwarded_allow_ips",
        "Proxies whose `X-Forwarded-For` and `X-Forwarded-Proto` are believed: addresses or networks, `*` for any (comma-separated).",
        parse_forwarded_allow_ips,
        [],
        env="KVCDN_FORWARDED_ALLOW_IPS",
        flag="--forwarded-allow-ips",
        default_doc="none, not even loopback",
    ),
)


def config_path(given: str | None = None) -> tuple[Path, bool]:
    """The config file and whether it was asked for: ``--config``, else ``$KVCDN_SERVER_CONFIG``,
    else ``$XDG_CONFIG_HOME/kvcdn/server.toml`` (which may be missing)."""
    chosen = given or os.environ.get(CONFIG_ENV, "").strip()
    if chosen:
        return Path(chosen).expanduser(), True
    return config_home() / "server.toml", False


_PASSWORD = re.compile(r"://[^:/@]+:[^@/]+@")


def read_file_settings(path: Path, required: bool) -> dict[str, Any]:
    """The config file's settings; a database password only from a file no one else may read."""
    values = settings.read_config_file(path, SETTINGS, missing_ok=not required)
    url = values.get("database_url")
    if isinstance(url, str) and _PASSWORD.search(url) and path.stat().st_mode & 0o077:
        raise KvcdnError(
            f"config file {path}: 'database_url' holds a password but the file is readable by other users; "
            "chmod 600 it or set KVCDN_DATABASE_URL"
        )
    return values


def _secret(value: str | None, path: Path, created: list[Path]) -> bytes:
    return value.encode() if value else _secret_file(path, created)


def load_config(config_file: str | None = None, **flags: Any) -> ServerConfig:
    """Resolve :data:`SETTINGS`; ``flags`` are the command line's values by setting name."""
    home = server_home()
    created: list[Path] = []
    path, required = config_path(config_file)
    values, sources = settings.resolve(SETTINGS, flags, read_file_settings(path, required), path)
    return ServerConfig(
        home=home,
        storage_uri=values["storage"] or str(home / "objects"),
        database_url=values["database_url"] or f"sqlite:///{home / 'kvcdn.db'}",
        models=values["models"],
        public_url=values["public_url"],
        issuer_url=values["issuer_url"],
        client_id=values["client_id"],
        jwt_algorithms=values["jwt_algorithms"],
        jwt_leeway=values["jwt_leeway"],
        api_key_seed=_secret(values["api_key_seed"], home / "api-key-seed", created),
        admin_secret=_secret(values["admin_secret"], home / "admin-secret", created).decode(),
        url_key=_secret(values["url_signing_key"], home / "url-signing-key", created),
        env_orgs=values["api_key_orgs"],
        quota_artifacts=values["quota_artifacts"],
        quota_bytes=values["quota_storage_bytes"],
        max_artifact_bytes=values["max_artifact_bytes"],
        upload_ttl=values["upload_url_ttl"],
        download_ttl=values["download_url_ttl"],
        pending_grace=values["pending_grace"],
        lease_seconds=values["lease_seconds"],
        orphan_grace=values["orphan_grace"],
        gc_interval=values["gc_interval"],
        orgs_refresh=values["orgs_refresh"],
        infer_concurrency=values["infer_concurrency"],
        infer_timeout=values["infer_timeout"],
        infer_max_models=values["infer_max_models"],
        infer_cache_bytes=values["infer_cache_bytes"],
        infer_device=values["infer_device"],
        infer_dtype=values["infer_dtype"],
        infer_per_tenant=values["infer_per_tenant"],
        infer_max_new_tokens=values["infer_max_new_tokens"],
        infer_max_question_tokens=values["infer_max_question_tokens"],
        infer_max_question_bytes=values["infer_max_question_bytes"],
        infer_max_context_tokens=values["infer_max_context_tokens"],
        infer_model_bytes=values["infer_model_bytes"],
        infer_engine=values["infer_engine"],
        telemetry_url=values["telemetry_url"],
        telemetry_secret=values["telemetry_secret"],
        created_secrets=created,
        forwarded_allow_ips=values["forwarded_allow_ips"],
        host=values["host"],
        port=values["port"],
        log_level=values["log_level"],
        config_file=path if path.is_file() else None,
        sources=sources,
    )
