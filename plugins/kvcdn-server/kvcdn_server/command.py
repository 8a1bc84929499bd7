"""``kvcdn serve``: run the hosted API (loopback only unless told otherwise)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import click


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
@click.option(
    "--host",
    default=None,
    help="Address to bind; the default is loopback only (put TLS and a load balancer in front otherwise) "
    "[default: 127.0.0.1].",
)
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="TCP port to listen on [default: 8080].")
@click.option(
    "--storage",
    default=None,
    metavar="PATH|s3://bucket/prefix",
    help="Where artifacts live [env KVCDN_STORAGE; default: $XDG_DATA_HOME/kvcdn/server/objects].",
)
@click.option(
    "--database",
    default=None,
    metavar="URL",
    help="Where the server keeps its state: postgresql://user@host/db for several replicas, or "
    "sqlite:///PATH [env KVCDN_DATABASE_URL; default: SQLite file $XDG_DATA_HOME/kvcdn/server/kvcdn.db].",
)
@click.option(
    "--models",
    default=None,
    metavar="ID,...",
    help="Models inference may load, and the only ones: hub ids (from the local cache) "
    "or local directories [env KVCDN_MODELS].",
)
@click.option(
    "--public-url",
    default=None,
    help="External base URL used in signed links, e.g. https://kv.example.com [env KVCDN_PUBLIC_URL; "
    "default: the address it listens on]. The request's Host header is never used.",
)
@click.option("--issuer-url", default=None, help="OIDC issuer whose access tokens are accepted [env KVCDN_ISSUER_URL].")
@click.option(
    "--client-id", default=None, help="Audience required in access tokens [env KVCDN_CLIENT_ID; default kvcdn-cli]."
)
@click.option(
    "--infer-concurrency",
    type=click.IntRange(1),
    default=None,
    help="Inference requests run at once; more get 429 [env KVCDN_INFER_CONCURRENCY; default 2].",
)
@click.option(
    "--infer-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds before an inference request gets 504 [env KVCDN_INFER_TIMEOUT; default 120].",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda", "mps"]),
    default=None,
    help="Where inference runs [env KVCDN_INFER_DEVICE; default auto].",
)
@click.option(
    "--infer-dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default=None,
    help="The compute dtype of inference; artifacts computed in another are refused "
    "[env KVCDN_INFER_DTYPE; default auto: float32 on CPU, bfloat16 on CUDA].",
)
@click.option(
    "--forwarded-allow-ips",
    default=None,
    metavar="IP|NET,...",
    help="Proxies whose X-Forwarded-For and X-Forwarded-Proto are believed (addresses or networks, "
    "* for any) [env KVCDN_FORWARDED_ALLOW_IPS; default: none, not even loopback].",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default=None,
    help="Least severe server log lines shown on stderr (requests are logged at info) [default: info].",
)
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
        click.echo("warning: signed URLs will name 127.0.0.1; set --public-url to the address clients use", err=True)
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
        click.echo(f"warning: listening on {host}, not loopback: serve it behind TLS", err=True)
    # The same rule as config: an empty variable means "not set", and the secret is the file's.
    secret_hint = (
        "$KVCDN_ADMIN_SECRET"
        if os.environ.get("KVCDN_ADMIN_SECRET", "").strip()
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
