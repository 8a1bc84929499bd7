"""Server settings from flags and ``KVCDN_*`` variables, and the secrets created on first start.

Secrets (API-key seed, admin secret, URL-signing key) come from the environment when set, which is
how several replicas share them; otherwise each is a 0600 file under the server's data directory,
created with 32 random bytes on first start.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from kvcdn_core import KvcdnError, data_home

GIB = 1 << 30


def server_home() -> Path:
    """``$XDG_DATA_HOME/kvcdn/server``."""
    return data_home() / "server"


def _int_env(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise KvcdnError(f"{name} must be an integer, not '{raw}'") from None
    if value < minimum:
        raise KvcdnError(f"{name} must be at least {minimum}")
    return value


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise KvcdnError(f"{name} must be a number, not '{raw}'") from None
    if value <= 0:
        raise KvcdnError(f"{name} must be positive")
    return value


def _list_env(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


@dataclasses.dataclass
class ServerConfig:
    """Everything the app needs; built by :func:`load_config` from flags and the environment."""

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
    #: addresses (IPs or networks) whose X-Forwarded-For/-Proto are believed; none by default
    forwarded_allow_ips: list[str] = dataclasses.field(default_factory=list)


#: secrets given through the environment are at least this long
MIN_SECRET = 32
ALLOWED_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")


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


def _secret(env: str, path: Path, created: list[Path]) -> bytes:
    value = os.environ.get(env, "").strip()
    if value:
        if len(value) < MIN_SECRET:
            raise KvcdnError(
                f"{env} is too short: use at least {MIN_SECRET} characters (32 random bytes in hex is best)"
            )
        return value.encode()
    return _secret_file(path, created)


def parse_orgs(items: list[str]) -> dict[str, int]:
    """``acme,beta:2`` → ``{"acme": 1, "beta": 2}`` (``:N`` is the key generation after rotations)."""
    from kvcdn_server.apikeys import check_slug

    orgs = {}
    for item in items:
        slug, _, gen = item.partition(":")
        try:
            orgs[check_slug(slug)] = int(gen) if gen else 1
        except ValueError:
            raise KvcdnError(f"KVCDN_API_KEY_ORGS: bad generation in '{item}'") from None
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


def parse_forwarded_allow_ips(raw: str) -> list[str]:
    """``10.0.0.5,10.1.0.0/16`` → the proxies whose forwarded headers are believed (``*``: any)."""
    import ipaddress

    allowed = [part.strip() for part in raw.split(",") if part.strip()]
    for item in allowed:
        if item == "*":
            continue
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise KvcdnError(f"--forwarded-allow-ips: '{item}' is not an IP address or network") from None
    return allowed


def _device(value: str) -> str:
    if value not in ("auto", "cpu", "cuda", "mps"):
        raise KvcdnError(f"inference device must be auto, cpu, cuda or mps, not '{value}'")
    return value


def _dtype(value: str) -> str:
    if value not in INFER_DTYPES:
        raise KvcdnError(f"inference dtype must be one of {', '.join(INFER_DTYPES)}, not '{value}'")
    return value


#: compute dtypes the server may be told to use (auto: float32 on CPU, bfloat16 on CUDA)
INFER_DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_config(
    storage: str | None = None,
    models: str | None = None,
    public_url: str | None = None,
    issuer_url: str | None = None,
    client_id: str | None = None,
    infer_concurrency: int | None = None,
    infer_timeout: float | None = None,
    device: str | None = None,
    database: str | None = None,
    dtype: str | None = None,
    forwarded_allow_ips: str | None = None,
) -> ServerConfig:
    home = server_home()
    created: list[Path] = []
    storage_uri = storage or os.environ.get("KVCDN_STORAGE", "").strip() or str(home / "objects")
    model_list = [m.strip() for m in (models or "").split(",") if m.strip()] or _list_env("KVCDN_MODELS")
    algorithms = _list_env("KVCDN_JWT_ALGORITHMS") or ["RS256", "PS256", "ES256"]
    bad = [a for a in algorithms if a not in ALLOWED_ALGORITHMS]
    if bad:
        raise KvcdnError(f"KVCDN_JWT_ALGORITHMS: {', '.join(bad)} not allowed (asymmetric algorithms only)")
    return ServerConfig(
        home=home,
        storage_uri=storage_uri,
        database_url=(database or os.environ.get("KVCDN_DATABASE_URL", "").strip() or f"sqlite:///{home / 'kvcdn.db'}"),
        models=model_list,
        public_url=(public_url or os.environ.get("KVCDN_PUBLIC_URL", "").strip() or None),
        issuer_url=check_issuer_url(issuer_url or os.environ.get("KVCDN_ISSUER_URL", "").strip() or None),
        client_id=client_id or os.environ.get("KVCDN_CLIENT_ID", "").strip() or "kvcdn-cli",
        jwt_algorithms=algorithms,
        jwt_leeway=_int_env("KVCDN_JWT_LEEWAY", 30),
        api_key_seed=_secret("KVCDN_API_KEY_SEED", home / "api-key-seed", created),
        admin_secret=_secret("KVCDN_ADMIN_SECRET", home / "admin-secret", created).decode(),
        url_key=_secret("KVCDN_URL_SIGNING_KEY", home / "url-signing-key", created),
        env_orgs=parse_orgs(_list_env("KVCDN_API_KEY_ORGS")),
        quota_artifacts=_int_env("KVCDN_QUOTA_ARTIFACTS", 1000),
        quota_bytes=_int_env("KVCDN_QUOTA_STORAGE_BYTES", 10 * GIB),
        max_artifact_bytes=_int_env("KVCDN_MAX_ARTIFACT_BYTES", 50 * GIB, 1),
        upload_ttl=_int_env("KVCDN_UPLOAD_URL_TTL", 3600, 1),
        download_ttl=_int_env("KVCDN_DOWNLOAD_URL_TTL", 3600, 1),
        pending_grace=_int_env("KVCDN_PENDING_GRACE", 900),
        lease_seconds=_float_env("KVCDN_LEASE_SECONDS", 30.0),
        orphan_grace=_float_env("KVCDN_ORPHAN_GRACE", 3600.0),
        gc_interval=_float_env("KVCDN_GC_INTERVAL", 60.0),
        orgs_refresh=_float_env("KVCDN_ORGS_REFRESH", 5.0),
        infer_concurrency=infer_concurrency or _int_env("KVCDN_INFER_CONCURRENCY", 2, 1),
        infer_timeout=infer_timeout or _float_env("KVCDN_INFER_TIMEOUT", 120.0),
        infer_max_models=_int_env("KVCDN_INFER_MAX_MODELS", 2, 1),
        infer_cache_bytes=_int_env("KVCDN_INFER_CACHE_BYTES", 4 * GIB, 1),
        infer_device=_device(device or os.environ.get("KVCDN_INFER_DEVICE", "").strip() or "auto"),
        infer_dtype=_dtype(dtype or os.environ.get("KVCDN_INFER_DTYPE", "").strip() or "auto"),
        infer_per_tenant=_int_env("KVCDN_INFER_PER_TENANT", 0),
        infer_max_new_tokens=_int_env("KVCDN_INFER_MAX_NEW_TOKENS", 256, 1),
        infer_max_question_tokens=_int_env("KVCDN_INFER_MAX_QUESTION_TOKENS", 1024, 1),
        infer_max_question_bytes=_int_env("KVCDN_INFER_MAX_QUESTION_BYTES", 0),
        infer_max_context_tokens=_int_env("KVCDN_INFER_MAX_CONTEXT_TOKENS", 32768, 1),
        infer_model_bytes=_int_env("KVCDN_INFER_MODEL_BYTES", 16 * GIB, 1),
        telemetry_url=os.environ.get("KVCDN_TELEMETRY_URL", "").strip() or None,
        telemetry_secret=os.environ.get("KVCDN_TELEMETRY_SECRET", "").strip() or None,
        created_secrets=created,
        forwarded_allow_ips=parse_forwarded_allow_ips(
            forwarded_allow_ips if forwarded_allow_ips is not None else os.environ.get("KVCDN_FORWARDED_ALLOW_IPS", "")
        ),
    )
