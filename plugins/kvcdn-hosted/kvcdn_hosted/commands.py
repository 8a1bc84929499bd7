"""The hosted commands: login, logout, api-key, upload, list, download, delete, whoami, quota,
admin mint-api-key, infer.

Every command resolves its settings (flag → env → config → defaults), does its work, writes its
output and then sends one telemetry event (see :mod:`kvcdn_hosted.telemetry`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

import click

import kvcdn_wire as wire
from kvcdn_core import (
    COMPOSE_RULES,
    DEFAULT_COMPOSE_RULE,
    DEFAULT_RECOMPUTE,
    CheckFailed,
    KvcdnError,
    emit_json,
    print_table,
    warn,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvcdn_core import StorageBackend
    from kvcdn_hosted.config import Settings
    from kvcdn_hosted.storage import HostedStorage
    from kvcdn_wire.responses import ManifestSummary, Quota

# -- shared options and plumbing -----------------------------------------------------------------


def endpoint_options(f):
    f = click.option(
        "--api-key",
        "api_key",
        default=None,
        metavar="KEY",
        help="Org API key (kv_...) [env KVCDN_API_KEY]; wins over a login session.",
    )(f)
    f = click.option(
        "--api-url", "api_url", default=None, metavar="URL", help="Hosted endpoint [env KVCDN_API_URL, config api_url]."
    )(f)
    return f


def issuer_options(f):
    f = click.option(
        "--client-id",
        "client_id",
        default=None,
        help="OIDC client id [env KVCDN_CLIENT_ID, config client_id, default kvcdn-cli].",
    )(f)
    f = click.option(
        "--issuer-url",
        "issuer_url",
        default=None,
        metavar="URL",
        help="OIDC issuer [env KVCDN_ISSUER_URL, config issuer_url].",
    )(f)
    return f


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bars.")


def output_format(*extra: str):
    """``--format``: table for people, json for tools (and the command's extra forms)."""
    more = {"ids": "ids: one artifact id a line"}
    text = "table for people, json for tools" + "".join(f"; {more[e]}" for e in extra) + "."
    return click.option(
        "--format", "fmt", type=click.Choice(["table", "json", *extra]), default="table", show_default=True, help=text
    )


SETTING_FLAGS = ("api_url", "api_key", "issuer_url", "client_id")


def settings_from(kwargs: dict):
    from kvcdn_hosted.config import load_settings

    return load_settings(**{k: kwargs.get(k) for k in SETTING_FLAGS if k in kwargs})


def hosted_command(name: str):
    """Run a command body, then send its telemetry event, success or not. An error is reported by
    core's command group, as for every kvcdn command: one line and the documented exit code."""

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            started, success = time.monotonic(), False
            try:
                result = f(*args, **kwargs)
                success = True
                return result
            finally:
                _telemetry(kwargs, name, started, success)

        return wrapper

    return decorate


def _telemetry(kwargs: dict, name: str, started: float, success: bool) -> None:
    from kvcdn_hosted import telemetry

    try:
        settings = settings_from(kwargs)
    except Exception:  # a broken config already produced its own error
        return
    telemetry.send(settings, name, time.monotonic() - started, success)


def _hosted(settings, quiet: bool = True):
    from kvcdn_hosted.storage import HostedStorage

    settings.require_api_url()
    return HostedStorage(settings, quiet=quiet)


class _Endpoint:
    """The artifacts of a hosted endpoint, by the ids its server gives them (with visibility and
    the server's own records): what upload, list, download and delete do there."""

    def __init__(self, storage: HostedStorage) -> None:
        self.storage = storage

    def upload(self, source: Path, name: str, visibility: Literal["private", "public"], force: bool) -> dict:
        return _sent(self.storage.upload(source, name, visibility))

    def listing(self, long_: bool) -> list[_Listed]:
        return [
            _Listed(_sent(a), a.artifact_id, a.name, a.size_bytes, a.manifest, a.visibility, a.created_at, a.sha256)
            for a in self.storage.artifacts()
        ]

    def default_name(self, artifact_id: str) -> str:
        try:
            name = self.storage.describe(artifact_id).name
        except KvcdnError:
            name = ""  # a public artifact of another tenant: download-url works, describe may not
        return _default_download_name(artifact_id, name)

    def fetch(self, artifact_id: str, target: Path) -> None:
        self.storage.download(artifact_id, target)

    def find(self, artifact_id: str) -> tuple[str, str]:
        name = self.storage.describe(artifact_id).name
        return artifact_id, f"{artifact_id} ({name})" if name else artifact_id

    def delete(self, artifact_id: str) -> None:
        self.storage.remove(artifact_id)


class _Store:
    """The artifacts of any other storage backend, through the storage contract alone: an
    artifact's id is its key (its name and ``.kv``)."""

    def __init__(self, backend: StorageBackend, uri: str) -> None:
        self.backend, self.uri = backend, uri

    def upload(self, source: Path, name: str, visibility: str, force: bool) -> dict:
        from kvcdn_hosted.transfer import sha256_file

        key = _store_key(name)
        if not force and self.backend.exists(key):
            raise KvcdnError(f"'{key}' exists in {self.uri}; pass --force to replace it or --name to choose another")
        self.backend.put_file(key, source)
        size = source.stat().st_size
        return {
            "artifact_id": key,
            "name": name,
            "size_bytes": size,
            "sha256": sha256_file(source),
            "storage": self.uri,
        }

    def listing(self, long_: bool) -> list[_Listed]:
        from kvcdn_wire.responses import ManifestSummary

        listed = []
        for o in self.backend.list():
            if o.key.endswith(".kv"):
                item: dict = {"artifact_id": o.key, "name": o.key, "size_bytes": o.size}
                summary = None
                if long_:  # the long columns come from each artifact's header: read it, not the data
                    summary = item["manifest"] = _stored_summary(self.backend, o.key, o.size)
                manifest = None if summary is None else ManifestSummary(**summary)
                listed.append(_Listed(item, o.key, o.key, o.size, manifest))
        return listed

    def default_name(self, artifact_id: str) -> str:
        name = Path(artifact_id).name
        return name if name.endswith(".kv") else name + ".kv"

    def fetch(self, artifact_id: str, target: Path) -> None:
        _download_generic(self.backend, _store_key(artifact_id), target)

    def find(self, artifact_id: str) -> tuple[str, str]:
        key = _store_key(artifact_id)
        if not self.backend.exists(key):
            raise KvcdnError(f"no artifact '{key}' in {self.uri}")
        return key, key

    def delete(self, artifact_id: str) -> None:
        self.backend.delete(artifact_id)


def _artifacts(uri: str | None, settings: Settings, quiet: bool) -> _Endpoint | _Store:
    """The artifacts a command works on: the hosted endpoint's, unless ``--to/--from`` names
    another store (a ``kvcdn+https://`` URI is an endpoint too)."""
    from kvcdn_hosted.storage import HostedStorage

    if uri is None:
        return _Endpoint(_hosted(settings, quiet))
    from kvcdn_core import open_storage

    backend = open_storage(uri)
    if isinstance(backend, HostedStorage):
        backend.quiet = quiet
        return _Endpoint(backend)
    return _Store(backend, uri)


def _human_bytes(n) -> str:
    from kvcdn_core import human_bytes

    return human_bytes(float(n or 0))


def _table(rows: list[tuple]) -> None:
    print_table(rows)


def _check_upload_source(path: str) -> tuple[Path, dict]:
    """Refuse a non-.kv or unreadable file before any network call."""
    from kvcdn_core import artifact

    source = Path(path)
    if not source.name.endswith(".kv"):
        raise KvcdnError(f"'{path}' is not a .kv artifact (the file name must end in .kv)")
    if not source.is_file():
        raise KvcdnError(f"artifact '{path}' does not exist" if not source.exists() else f"'{path}' is not a file")
    if not os.access(source, os.R_OK):
        raise KvcdnError(f"artifact '{path}' is not readable")
    return source, artifact.read_header(source).manifest


# -- login, logout, api-key -------------------------------------------------------------------------


@click.command("login")
@issuer_options
@click.option("--no-browser", is_flag=True, help="Only print the URL and code; do not open a browser.")
@click.option(
    "--flow",
    type=click.Choice(["auto", "device", "browser"]),
    default="auto",
    show_default=True,
    help="auto: the device flow when the issuer offers it, else browser (auth code + PKCE).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=300,
    show_default=True,
    help="Seconds to wait for the browser redirect (browser flow).",
)
@output_format()
@hosted_command("login")
def login(issuer_url, client_id, no_browser, flow, timeout_s, fmt):
    """Log in with your identity provider (OIDC) and store the session privately."""
    import httpx

    from kvcdn_hosted import credentials, oidc

    settings = settings_from(locals())
    issuer = settings.require_issuer_url()
    resource = settings.oidc_resource
    say = functools.partial(click.echo, err=True)
    opener = None
    if not no_browser:
        import webbrowser

        opener = webbrowser.open
    with httpx.Client(headers={"Accept": "application/json"}) as http:
        meta = oidc.discover(http, issuer)
        use_device = meta.get("device_authorization_endpoint") and flow in ("auto", "device")
        if flow == "device" and not use_device:
            raise KvcdnError(f"the issuer {issuer} does not offer the device flow; use --flow browser")
        if use_device:
            tokens = oidc.device_login(
                http,
                meta,
                settings.client_id,
                scope=settings.oidc_scope,
                resource=resource,
                say=say,
                open_browser=opener,
            )
        else:
            tokens = oidc.pkce_login(
                http,
                meta,
                settings.client_id,
                scope=settings.oidc_scope,
                resource=resource,
                timeout_s=timeout_s,
                say=say,
                open_browser=opener,
            )
    session = oidc.session_from_tokens(tokens, meta, issuer, settings.client_id, resource)
    credentials.update(session=session)
    if fmt == "json":
        emit_json({"issuer": issuer, "credentials": str(credentials.credentials_path())})
    else:
        click.echo(f"logged in to {issuer}; session stored in {credentials.credentials_path()}")
    if credentials.load().get("api_key") or settings.api_key:
        click.echo("note: an API key is set and takes precedence over this login (kvcdn api-key clear)", err=True)


@click.command("logout")
@hosted_command("logout")
def logout():
    """Remove the stored login session and API key (and revoke the refresh token)."""
    import httpx

    from kvcdn_hosted import credentials, oidc
    from kvcdn_hosted.config import given_in_environment

    stored = credentials.load()
    if stored.get("session"):
        with httpx.Client() as http:
            oidc.revoke(http, stored["session"])
    removed = credentials.clear()
    click.echo("logged out: stored credentials removed" if removed else "no stored credentials")
    if given_in_environment("api_key"):
        click.echo("note: KVCDN_API_KEY is still set in your environment", err=True)


@click.group("api-key")
def api_key_group():
    """Store, check or remove an org API key (kv_ followed by 64 hex characters)."""


@api_key_group.command("set")
@click.argument("key")
@hosted_command("api-key set")
def api_key_set(key):
    """Store KEY (use - to read it from standard input, keeping it out of shell history)."""
    from kvcdn_hosted import credentials
    from kvcdn_hosted.apikey import mask, validate_api_key

    if key == "-":
        key = sys.stdin.readline()
    key = validate_api_key(key)
    credentials.update(api_key=key)
    click.echo(f"API key {mask(key)} stored in {credentials.credentials_path()} (check it: kvcdn api-key verify)")


@api_key_group.command("verify")
@endpoint_options
@output_format()
@hosted_command("api-key verify")
def api_key_verify(api_url, api_key, fmt):
    """Ask the endpoint whether the API key in use is valid, and for which org (exit 1 if not)."""
    from kvcdn_hosted.apikey import mask
    from kvcdn_hosted.client import HostedClient, resolve_credential

    settings = settings_from(locals())
    settings.require_api_url()
    credential = resolve_credential(settings)
    if credential is None or credential.method != "api_key":
        raise KvcdnError("no API key set: kvcdn api-key set KEY, KVCDN_API_KEY or --api-key")
    with HostedClient(settings, credential=credential) as client:
        response = client.request("POST", wire.VERIFY_API_KEY, what="api-key verify", ok=(200, 401))
    if response.status_code == 401:  # the check ran and the key failed it: exit 1
        raise CheckFailed(
            f"the server at {settings.api_url} rejects the API key {mask(credential.token)} "
            f"from {credential.source}; ask your org admin for a valid key"
        )
    from kvcdn_hosted.client import parse_answer
    from kvcdn_wire.responses import KeyVerification

    info = parse_answer(KeyVerification, response, "api-key verify")
    if fmt == "json":
        emit_json(_sent(info))
    else:
        click.echo(f"valid API key for org {info.org} (customer {info.customer_id}), from {credential.source}")


@api_key_group.command("clear")
@hosted_command("api-key clear")
def api_key_clear():
    """Remove the stored API key (a login session stays)."""
    from kvcdn_hosted import credentials

    had = "api_key" in credentials.load()
    credentials.update(api_key=None)
    click.echo("stored API key removed" if had else "no stored API key")


# -- artifacts --------------------------------------------------------------------------------------


@click.command("upload")
@click.argument("artifact_path", metavar="ARTIFACT.kv")
@click.option("--name", default=None, help="Name to list the artifact under [default: the file's name without .kv].")
@click.option(
    "--visibility",
    type=click.Choice(["private", "public"]),
    default="private",
    show_default=True,
    help="private: your org only; public: any signed-in user may find, download and infer from it.",
)
@click.option(
    "--to",
    "to_uri",
    default=None,
    metavar="URI",
    help=(
        "Another store: a URI of any installed storage plugin (kvcdn plugins lists their schemes), "
        "e.g. s3://bucket/prefix, a local directory, or kvcdn+https://host [default: the endpoint]."
    ),
)
@click.option("--force", is_flag=True, help="Replace an object of the same name in a --to store.")
@click.option(
    "--chunked",
    is_flag=True,
    help=(
        "Upload to the endpoint by chunks: send only the chunks it does not hold for your org yet "
        "(--format json reports bytes_moved and bytes_saved)."
    ),
)
@output_format()
@endpoint_options
@quiet_option
@hosted_command("upload")
def upload(artifact_path, name, visibility, to_uri, force, chunked, fmt, api_url, api_key, quiet):
    """Upload a .kv artifact and print its id."""
    source, _manifest = _check_upload_source(artifact_path)
    name = name or source.name.removesuffix(".kv") or source.name
    settings = settings_from(locals())
    if chunked:
        if to_uri is not None:
            raise KvcdnError("--chunked uploads to the endpoint; for another store use kvcdn store put")
        record = _hosted(settings, quiet).upload_chunked(source, name, visibility).as_dict()
    else:
        record = _artifacts(to_uri, settings, quiet).upload(source, name, visibility, force)
    if fmt == "json":
        emit_json(record)
    else:
        click.echo(record["artifact_id"])


@click.command("list")
@output_format("ids")
@click.option("--long", "long_", is_flag=True, help="More columns: sha256, architecture, dtype, quantization.")
@click.option("--from", "from_uri", default=None, metavar="URI", help="Another store (see upload --to).")
@endpoint_options
@hosted_command("list")
def list_cmd(fmt, long_, from_uri, api_url, api_key):
    """List the artifacts you can see (all pages)."""
    settings = settings_from(locals())
    listed = _artifacts(from_uri, settings, True).listing(long_)
    if fmt == "json":
        emit_json([a.json for a in listed])
    elif fmt == "ids":
        for a in listed:
            click.echo(a.artifact_id)
    elif not listed:
        click.echo("no artifacts", err=True)
    else:
        head = ["ID", "NAME", "SIZE", "TOKENS", "MODEL", "VISIBILITY", "CREATED"]
        if long_:
            head += ["ARCHITECTURE", "DTYPE", "QUANT", "SHA256"]
        rows = [tuple(head)]
        for a in listed:
            m = a.manifest
            row = [
                a.artifact_id,
                a.name,
                _human_bytes(a.size_bytes),
                m.tokens if m else None,
                m.model_id if m else None,
                a.visibility,
                a.created_at,
            ]
            if long_:
                quant = (m.quantization or "none") if m else None  # unknown is "-", not "none"
                row += [m.architecture if m else None, m.dtype if m else None, quant, a.sha256]
            rows.append(tuple("-" if v is None else v for v in row))
        _table(rows)


class _Listed(NamedTuple):
    """One listed artifact: what ``--format json`` prints, and the facts of the table."""

    json: dict
    artifact_id: str
    name: str
    size_bytes: int
    manifest: ManifestSummary | None = None
    visibility: str | None = None
    created_at: str | None = None
    sha256: str | None = None


def _sent(answer) -> dict:
    """A server's answer as it sent it (the fields it set, and any this client does not know)."""
    return answer.model_dump(mode="json", exclude_unset=True)


def _stored_summary(backend, key: str, size: int) -> dict | None:
    """The listing facts of a stored artifact from its header alone; None when it has no readable one."""
    from kvcdn_core import artifact

    try:
        with backend.open_read(key) as stream:
            return artifact.summary(artifact.read_header_from(stream, size, key).manifest)
    except KvcdnError:
        return None


def _store_key(artifact_id: str) -> str:
    """An artifact's key in a plain store: the id that upload printed, with or without its ``.kv``."""
    return artifact_id if artifact_id.endswith(".kv") else artifact_id + ".kv"


def _default_download_name(artifact_id: str, name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    safe = safe.removesuffix(".kv") if safe else ""
    return (safe or re.sub(r"[^A-Za-z0-9._-]+", "_", artifact_id)) + ".kv"


@click.command("download")
@click.argument("artifact_id", metavar="ID")
@click.option(
    "--output",
    "-o",
    default=None,
    metavar="PATH",
    help="File or existing directory to write to [default: ./<name>.kv].",
)
@click.option("--force", is_flag=True, help="Replace an existing file.")
@click.option("--from", "from_uri", default=None, metavar="URI", help="Another store (see upload --to).")
@click.option(
    "--chunked",
    is_flag=True,
    help="Download a chunked artifact of the endpoint by its chunks, each checked as it arrives.",
)
@endpoint_options
@quiet_option
@output_format()
@hosted_command("download")
def download(artifact_id, output, force, from_uri, chunked, api_url, api_key, quiet, fmt):
    """Download an artifact, check its sha256 and .kv header, and write it atomically."""
    from kvcdn_core import check_output, ensure_kv_suffix

    settings = settings_from(locals())
    artifacts = _artifacts(from_uri, settings, quiet)
    if output and not Path(output).is_dir():
        target = ensure_kv_suffix(output)
    else:  # the artifact's own name, in the current directory or inside --output's directory (as cp does)
        target = (Path(output) if output else Path()) / artifacts.default_name(artifact_id)
    check_output(target, force)
    moved = {}
    with _terminate_as_interrupt():
        if chunked:
            if from_uri is not None:
                raise KvcdnError("--chunked downloads from the endpoint; for another store use kvcdn store get")
            report = _hosted(settings, quiet).download_chunked(artifact_id, target)
            moved = {"bytes_moved": report.bytes_moved, "bytes_saved": report.bytes_saved}
        else:
            artifacts.fetch(artifact_id, target)
    if fmt == "json":
        emit_json({"artifact_id": artifact_id, "path": str(target), "size_bytes": target.stat().st_size, **moved})
    else:
        click.echo(str(target))


@contextlib.contextmanager
def _terminate_as_interrupt():
    """Treat SIGTERM like Ctrl-C while a download runs, so its temporary file is removed too."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _download_generic(backend, key: str, target: Path) -> None:
    """Fetch from a plain storage backend into a temp file, check it is a .kv, then rename."""
    import tempfile

    from kvcdn_hosted.transfer import check_artifact

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        backend.get_file(key, tmp)
        check_artifact(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@click.command("delete")
@click.argument("artifact_id", metavar="ID")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--from", "from_uri", default=None, metavar="URI", help="Another store (see upload --to).")
@endpoint_options
@output_format()
@hosted_command("delete")
def delete(artifact_id, yes, from_uri, api_url, api_key, fmt):
    """Delete an artifact (asks first unless --yes)."""
    settings = settings_from(locals())
    artifacts = _artifacts(from_uri, settings, True)
    artifact_id, label = artifacts.find(artifact_id)
    if not yes:
        if not sys.stdin.isatty():
            raise KvcdnError(f"refusing to delete {label} without confirmation: pass --yes")
        click.confirm(f"Delete artifact {label}?", abort=True, err=True)
    artifacts.delete(artifact_id)
    if fmt == "json":
        emit_json({"artifact_id": artifact_id, "deleted": True})
    else:
        click.echo(f"deleted {artifact_id}")


@click.command("infer")
@click.argument("artifact_ids", metavar="ID...", nargs=-1, required=True)
@click.option("--question", default=None, help="Text to continue the artifact's context with (required).")
@click.option("-q", "question_short", default=None, hidden=True)  # the old spelling: -q is --quiet elsewhere
@click.option("--n", "n", type=click.IntRange(1, 256), default=32, show_default=True, help="Tokens to generate.")
@click.option(
    "--recompute",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="With several IDs: the share of the later documents' tokens recomputed, 0 to 1; 1 is the full "
    f"prefill [default: {DEFAULT_RECOMPUTE}].",
)
@click.option(
    "--select",
    "rule",
    type=click.Choice(COMPOSE_RULES),
    default=None,
    help=f"With several IDs: how the tokens to recompute are chosen [default: {DEFAULT_COMPOSE_RULE}].",
)
@click.option("--org", default=None, help="Org (older servers) [env KVCDN_DEFAULT_ORG].")
@click.option("--project", default=None, help="Project (older servers) [env KVCDN_DEFAULT_PROJECT].")
@output_format()
@endpoint_options
@hosted_command("infer")
def infer(artifact_ids, question, question_short, n, recompute, rule, org, project, fmt, api_url, api_key):
    """Continue from an uploaded artifact on the server (no prefill on either side).

    With several IDs: the server composes their documents in that order, as local `kvcdn continue
    --kv-path A --kv-path B` does (keys moved to their new positions, a share --recompute of the
    later documents' tokens recomputed), then feeds the question.
    """
    if question_short is not None:
        warn("infer -q is deprecated (-q means --quiet in every other command); use --question")
        question = question if question is not None else question_short
    if question is None:
        raise click.UsageError("Missing option '--question'.")
    if len(artifact_ids) < 2 and (recompute is not None or rule is not None):
        raise KvcdnError("--recompute and --select compose several artifacts: pass two or more IDs")
    settings = settings_from(locals())
    backend = _hosted(settings)
    first, *more = artifact_ids
    result = backend.infer(
        first,
        question,
        n,
        org or settings.default_org,
        project or settings.default_project,
        compose=more or None,
        recompute=recompute,
        select=rule,
    )
    if fmt == "json":
        emit_json(_sent(result))
    else:
        if result.composition is not None:
            c = result.composition
            click.echo(
                f"composed {len(c.artifact_ids)} artifacts: {result.reused_tokens} context tokens, "
                f"{c.recomputed_tokens} recomputed ({c.rule}, --recompute {c.recompute:g})",
                err=True,
            )
        click.echo(result.text)


# -- identity and quota -----------------------------------------------------------------------------


@click.command("whoami")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="json includes access_token, the credential in use (for curl); table never shows it.",
)
@endpoint_options
@hosted_command("whoami")
def whoami(fmt, api_url, api_key):
    """Who the endpoint says you are, and which credential is in use."""
    from kvcdn_hosted.client import HostedClient
    from kvcdn_wire.responses import Identity

    settings = settings_from(locals())
    with HostedClient(settings) as client:
        credential = client.require_credential("whoami")
        identity = client.read(Identity, "GET", wire.WHOAMI, what="whoami")
    if fmt == "json":
        info = _sent(identity)
        info.update(
            access_token=credential.token,
            credential=credential.method,
            credential_source=credential.source,
            api_url=settings.api_url,
        )
        emit_json(info)
        return
    rows = [
        ("endpoint", settings.api_url),
        ("customer", identity.customer_id),
        ("org", identity.org),
        ("method", identity.method),
        ("credential", credential.source),
    ]
    if credential.expires_at:
        left = int(credential.expires_at - time.time())
        rows.append(("expires in", f"{left} s"))
    for key, value in rows:
        click.echo(f"{key + ':':12} {value if value is not None else '-'}")


@click.command("quota")
@output_format()
@endpoint_options
@hosted_command("quota")
def quota(fmt, api_url, api_key):
    """Your limits and usage on the endpoint."""
    from kvcdn_hosted.client import HostedClient
    from kvcdn_wire.responses import Quota

    settings = settings_from(locals())
    with HostedClient(settings) as client:
        client.require_credential("quota")
        info = client.read(Quota, "GET", wire.QUOTA, what="quota")
    if fmt == "json":
        emit_json(_sent(info))
        return
    _table(_quota_rows(info))


def _quota_rows(info: Quota) -> list[tuple]:
    """``WHAT USED LIMIT``: each count the server reports (a limit or a usage of a newer server too)."""
    limits, usage = info.limits.model_dump(), info.usage.model_dump()
    rows = [("WHAT", "USED", "LIMIT")]
    for key in sorted(set(limits) | set(usage)):
        used, limit = usage.get(key), limits.get(key)
        if "bytes" in key:
            used = _human_bytes(used) if used is not None else None
            limit = _human_bytes(limit) if limit is not None else None
        rows.append((key, "-" if used is None else used, "-" if limit is None else limit))
    return rows


@click.group("admin")
def admin_group():
    """Operator commands (need the server's admin secret in KVCDN_ADMIN_SECRET)."""


@admin_group.command("mint-api-key")
@click.argument("org")
@output_format()
@click.option("--api-url", "api_url", default=None, metavar="URL", help="Hosted endpoint [env KVCDN_API_URL].")
@hosted_command("admin mint-api-key")
def mint_api_key(org, fmt, api_url):
    """Mint (derive) the API key of ORG; prints the key."""
    from kvcdn_hosted.client import HostedClient, insecure_remote
    from kvcdn_wire.responses import OrgKey

    settings = settings_from(locals())
    secret = settings.admin_secret
    if not secret:
        raise KvcdnError("set KVCDN_ADMIN_SECRET to the server's admin secret (kvcdn serve prints where it is)")
    with HostedClient(settings, auth=False) as client:
        if insecure_remote(client.api_url):
            warn(
                f"sending the admin secret over plain http to {client.api_url}; "
                "use https for anything but a loopback address"
            )
        info = client.read(
            OrgKey,
            "POST",
            wire.ADMIN_API_KEYS,
            what="admin mint-api-key",
            json={"org_slug": org},
            headers={"X-Kvcdn-Admin-Secret": secret},
        )
    if fmt == "json":
        emit_json(_sent(info))
    else:
        click.echo(info.api_key)


COMMANDS = (login, logout, api_key_group, upload, list_cmd, download, delete, infer, whoami, quota, admin_group)
