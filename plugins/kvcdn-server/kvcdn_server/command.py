"""``kvcdn serve``: run the hosted API (loopback only unless told otherwise)."""

from __future__ import annotations

import errno
import ipaddress
import socket

import click

from kvcdn_core import settings, warn
from kvcdn_server.config import INFER_DTYPES, LOG_LEVELS, SETTINGS


def _help(name: str) -> str:
    """A flag's help, from the settings table (the docs table says the same)."""
    return settings.flag_help(next(s for s in SETTINGS if s.name == name))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command("serve")
@click.option(
    "--config",
    "config_file",
    default=None,
    metavar="PATH",
    help="TOML file of settings (keys as in docs/deployment.md; no secrets) "
    "[env KVCDN_SERVER_CONFIG; default: $XDG_CONFIG_HOME/kvcdn/server.toml if there].",
)
@click.option("--host", default=None, help=_help("host"))
@click.option("--port", type=click.IntRange(0, 65535), default=None, help=_help("port"))
@click.option("--storage", default=None, metavar="PATH|s3://bucket/prefix", help=_help("storage"))
@click.option("--database", default=None, metavar="URL", help=_help("database_url"))
@click.option("--models", default=None, metavar="ID,...", help=_help("models"))
@click.option("--public-url", default=None, metavar="URL", help=_help("public_url"))
@click.option("--issuer-url", default=None, metavar="URL", help=_help("issuer_url"))
@click.option("--client-id", default=None, help=_help("client_id"))
@click.option("--infer-concurrency", type=click.IntRange(1), default=None, help=_help("infer_concurrency"))
@click.option("--infer-timeout", type=click.FloatRange(min=0, min_open=True), default=None, help=_help("infer_timeout"))
@click.option("--infer-engine", default=None, metavar="URL", help=_help("infer_engine"))
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "mps"]), default=None, help=_help("infer_device"))
@click.option("--infer-dtype", type=click.Choice(list(INFER_DTYPES)), default=None, help=_help("infer_dtype"))
@click.option("--forwarded-allow-ips", default=None, metavar="IP|NET,...", help=_help("forwarded_allow_ips"))
@click.option("--log-level", type=click.Choice(list(LOG_LEVELS)), default=None, help=_help("log_level"))
def serve(
    config_file,
    host,
    port,
    storage,
    database,
    models,
    public_url,
    issuer_url,
    client_id,
    infer_concurrency,
    infer_timeout,
    infer_engine,
    device,
    infer_dtype,
    forwarded_allow_ips,
    log_level,
):
    """Serve the kvcdn hosted API: artifact upload/list/download/delete, API keys, inference.

    State (artifacts, uploads, quotas, API-key generations) lives in a database: an SQLite file by
    default, PostgreSQL (--database) for several replicas; its schema is migrated on start. On
    first start it creates its API-key seed, admin secret and URL-signing key (files 0600 in
    $XDG_DATA_HOME/kvcdn/server/) unless KVCDN_API_KEY_SEED / KVCDN_ADMIN_SECRET /
    KVCDN_URL_SIGNING_KEY are set, and prints how to mint an org API key.

    Each setting is resolved flag, then environment variable, then config file, then default; the
    settings without a flag are in the config file and the environment (docs/deployment.md).
    """
    import uvicorn

    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    config = load_config(
        config_file,
        host=host,
        port=port,
        log_level=log_level,
        storage=storage,
        database_url=database,
        models=models,
        public_url=public_url,
        issuer_url=issuer_url,
        client_id=client_id,
        infer_concurrency=infer_concurrency,
        infer_timeout=infer_timeout,
        infer_engine=infer_engine,
        infer_device=device,
        infer_dtype=infer_dtype,
        forwarded_allow_ips=forwarded_allow_ips,
    )
    host, port = config.host, config.port
    check_local_models(config.models)
    sock = bind_socket(host, port)  # before any output: a busy port is the only line
    shown = f"[{host}]" if ":" in host else host
    if not config.public_url and host in ("0.0.0.0", "::"):
        shown = "127.0.0.1"  # "all interfaces" is no address a client can use
        warn("signed URLs will name 127.0.0.1; set --public-url to the address clients use")
    config.public_url = config.public_url or f"http://{shown}:{sock.getsockname()[1]}"
    app = create_app(config)
    base = config.public_url
    click.echo(
        f"kvcdn serve: storage {config.storage_uri}; database {_redacted(config.database_url)}; "
        "auth: org API keys"
        + (f", OIDC tokens from {config.issuer_url}" if config.issuer_url else "")
        + (f"; settings from {config.config_file}" if config.config_file else ""),
        err=True,
    )
    if config.created_secrets:
        click.echo("created " + ", ".join(str(p) for p in config.created_secrets) + " (mode 0600)", err=True)
    if not _is_loopback(host):
        warn(f"listening on {host}, not loopback: serve it behind TLS")
    # Where the resolved setting came from: its variable, else the file (an empty variable is unset).
    secret_hint = (
        "$KVCDN_ADMIN_SECRET"
        if config.sources.get("admin_secret") == "env KVCDN_ADMIN_SECRET"
        else f"$(cat {config.home / 'admin-secret'})"
    )
    click.echo(
        "mint an org API key with:\n"
        f'  curl -X POST {base}/api/v1/admin/api-keys -H "X-Kvcdn-Admin-Secret: {secret_hint}" '
        "-H 'Content-Type: application/json' -d '{\"org_slug\": \"my-org\"}'",
        err=True,
    )
    show_telemetry_events()
    proxies = config.forwarded_allow_ips  # uvicorn would otherwise believe any loopback client
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=config.log_level,
            proxy_headers=bool(proxies),
            forwarded_allow_ips=proxies or None,
            server_header=False,
        )
    )
    server.run(sockets=[sock])


def show_telemetry_events() -> None:
    """Telemetry events the server has no collector for: one JSON line each on stderr, as they are."""
    import logging
    import sys

    from kvcdn_server.telemetry import events

    if not events.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        events.addHandler(handler)
    events.setLevel(logging.INFO)
    events.propagate = False


def check_local_models(models: list[str]) -> None:
    """A local model path that is not there is a typo: say so now, not at the first inference."""
    from pathlib import Path

    from kvcdn_core import KvcdnError

    for model in models:
        if model.startswith((".", "/", "~")) and not (Path(model).expanduser() / "config.json").is_file():
            what = "has no config.json" if Path(model).expanduser().is_dir() else "does not exist"
            raise KvcdnError(f"--models: model directory '{model}' {what}")


def _redacted(url: str) -> str:
    """A database URL without its password, for the start-up line."""
    import re

    return re.sub(r"://([^:/@]+):[^@/]*@", r"://\1:***@", url)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket here, so that a busy port is one line and exit 2, not uvicorn's exit 3."""
    from kvcdn_core import KvcdnError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise KvcdnError(f"cannot listen on '{host}': {exc.strerror}") from None
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts need no wait
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise KvcdnError(f"port {port} on {host} is in use (pick another with --port)") from None
        raise KvcdnError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock
