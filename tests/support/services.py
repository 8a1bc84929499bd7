"""Real services for the hosted tests, each on 127.0.0.1 and torn down after use.

- :func:`oidc_issuer`: the node ``oidc-provider`` issuer in ``tests/support/oidc_issuer`` (run
  ``npm ci --prefix tests/support/oidc_issuer`` once).
- :func:`moto_s3`: moto's threaded S3 server.
- :func:`postgres`: a PostgreSQL server (Debian's binaries) in a temp dir, one database per test
  through :meth:`Postgres.new_database`.
- :func:`kvcdn_server`: ``kvcdn serve`` as a subprocess on a free port.
- :func:`device_flow_token` / :func:`browser_login`: get an access token from the issuer by driving
  its device-flow and login pages with httpx, as a person with a browser would.

These are plain context managers so that the pytest fixtures in ``tests/hosted/conftest.py`` (and
any other test module) can pick the scope they need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.budget import budget

SUPPORT = Path(__file__).resolve().parent
ISSUER_DIR = SUPPORT / "oidc_issuer"
REPO = SUPPORT.parent.parent

CLIENT_ID = "kvcdn-cli"
DEFAULT_RESOURCE = "https://api.kvcdn.test/"
SHORT_RESOURCE = "https://short.kvcdn.test/"  # access tokens live 1 s
OTHER_RESOURCE = "https://other.kvcdn.test/"  # audience "other-api"
ACCOUNTS = {"alice": "alice-password", "bob": "bob-password"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def _drain(stream, sink: list[str]) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)


@dataclasses.dataclass
class Issuer:
    url: str
    process: subprocess.Popen
    log: list[str]


def issuer_available() -> str | None:
    """Why the issuer cannot start here, or None when it can."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (ISSUER_DIR / "node_modules" / "oidc-provider").is_dir():
        return "run `npm ci --prefix tests/support/oidc_issuer` first"
    return None


@contextlib.contextmanager
def oidc_issuer(timeout: float = 30.0) -> Iterator[Issuer]:
    """Start the test issuer on a free loopback port; yield its URL and process."""
    problem = issuer_available()
    if problem:
        raise RuntimeError(f"cannot start the OIDC test issuer: {problem}")
    proc = subprocess.Popen(
        ["node", "issuer.mjs", "--port", "0"],
        cwd=ISSUER_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    try:
        deadline = time.monotonic() + budget(timeout)
        url = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            log.append(line)
            if line.startswith("READY "):
                url = line.split()[1]
                break
        if url is None:
            raise RuntimeError("OIDC test issuer did not start:\n" + "".join(log))
        threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
        yield Issuer(url, proc, log)
    finally:
        _stop(proc)


def _form_action(html: str, base: str) -> tuple[str, dict[str, str]]:
    """The action and hidden/default inputs of the first form of a page."""
    form = re.search(r"<form[^>]*action=\"([^\"]+)\"[^>]*>(.*?)</form>", html, re.S | re.I)
    if not form:
        raise AssertionError(f"no form on the page: {html[:500]}")
    action, body = form.group(1), form.group(2)
    fields = {}
    for tag in re.findall(r"<input[^>]*>", body, re.I):
        name = re.search(r'name="([^"]+)"', tag)
        value = re.search(r'value="([^"]*)"', tag)
        if name:
            fields[name.group(1)] = value.group(1) if value else ""
    return str(httpx.URL(base).join(action)), fields


def browser_login(client: httpx.Client, response: httpx.Response, username: str, password: str) -> httpx.Response:
    """From a page that leads to the issuer's login form, sign in; return the final response."""
    for _ in range(10):
        if "/interaction/" in str(response.url) and 'name="password"' in response.text:
            action, fields = _form_action(response.text, str(response.url))
            fields.update(login=username, password=password)
            response = client.post(action, data=fields)
            if response.status_code == 401:
                raise AssertionError("the issuer refused the login")
            return response
        if response.status_code >= 400:
            raise AssertionError(f"issuer page {response.url} answered {response.status_code}: {response.text[:300]}")
        action, fields = _form_action(response.text, str(response.url))
        response = client.post(action, data=fields)
    raise AssertionError("never reached the login form")


def device_flow_token(
    issuer_url: str,
    username: str = "alice",
    password: str | None = None,
    resource: str | None = None,
    scope: str = "openid email kvcdn",
    client_id: str = CLIENT_ID,
) -> dict:
    """Run the whole device flow against the issuer and return the token response (a dict).

    Plays both parts: the CLI (device authorization, token polling) and the person who opens the
    verification URL in a browser, signs in and confirms the code.
    """
    password = ACCOUNTS.get(username, "") if password is None else password
    with httpx.Client(base_url=issuer_url, timeout=budget(10)) as cli:
        data = {"client_id": client_id, "scope": scope}
        if resource:
            data["resource"] = resource
        start = cli.post("/device/auth", data=data)
        start.raise_for_status()
        device = start.json()
    with httpx.Client(follow_redirects=True, timeout=budget(10)) as browser:
        page = browser.get(device["verification_uri_complete"])
        # The verification page asks to confirm the pre-filled user code: submit its form.
        action, fields = _form_action(page.text, str(page.url))
        page = browser.post(action, data=fields)
        done = browser_login(browser, page, username, password)
        if done.status_code >= 400:
            raise AssertionError(f"device flow failed in the browser: {done.status_code} {done.text[:300]}")
    with httpx.Client(base_url=issuer_url, timeout=budget(10)) as cli:
        deadline = time.monotonic() + budget(20)
        while time.monotonic() < deadline:
            data = {
                "client_id": client_id,
                "device_code": device["device_code"],
                "grant_type": "urn:ietf:params:oauth:grant-type:device_code",
            }
            if resource:
                data["resource"] = resource
            token = cli.post("/token", data=data)
            body = token.json()
            if token.status_code == 200:
                return body
            if body.get("error") not in ("authorization_pending", "slow_down"):
                raise AssertionError(f"token request failed: {body}")
            time.sleep(0.2)
    raise AssertionError("device flow did not finish in time")


def browser_authorize(
    authorize_url: str, username: str = "alice", password: str | None = None, deliver: bool = False
) -> str:
    """Play the browser of an authorization-code (+PKCE) login that starts at ``authorize_url``.

    Signs in on the issuer's page and returns the URL the issuer redirects to (the client's
    loopback ``redirect_uri`` with ``code`` and ``state``). With ``deliver``, also GETs that URL, as
    a browser would, so a CLI waiting on its loopback listener receives the code.
    """
    password = ACCOUNTS.get(username, "") if password is None else password
    with httpx.Client(follow_redirects=False, timeout=budget(10)) as browser:
        response = browser.get(authorize_url)
        for _ in range(12):
            location = response.headers.get("location")
            if location is None:
                if 'name="password"' not in response.text:
                    raise AssertionError(
                        f"issuer page {response.url} answered {response.status_code}: {response.text[:300]}"
                    )
                action, fields = _form_action(response.text, str(response.url))
                fields.update(login=username, password=password)
                response = browser.post(action, data=fields)
                if response.status_code == 401:
                    raise AssertionError("the issuer refused the login")
                continue
            target = str(response.url.join(location))
            parsed = httpx.URL(target)
            if parsed.host in ("127.0.0.1", "localhost", "::1") and parsed.port != response.url.port:
                if deliver:
                    httpx.get(target, timeout=budget(10))
                return target
            response = browser.get(target)
    raise AssertionError("the authorization flow never redirected back to the client")


@dataclasses.dataclass
class MotoS3:
    endpoint: str
    server: object
    env: dict[str, str]


@contextlib.contextmanager
def moto_s3(bucket: str | None = "kvcdn-test") -> Iterator[MotoS3]:
    """moto's threaded S3 server on a free loopback port, with ``bucket`` created."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "KVCDN_S3_ENDPOINT_URL": endpoint,
        "KVCDN_S3_REGION": "us-east-1",
        "KVCDN_S3_ACCESS_KEY_ID": "testing",
        "KVCDN_S3_SECRET_ACCESS_KEY": "testing",
    }
    try:
        if bucket:
            import boto3

            boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            ).create_bucket(Bucket=bucket)
        yield MotoS3(endpoint, server, env)
    finally:
        server.stop()


@dataclasses.dataclass
class Postgres:
    port: int
    directory: Path
    #: ``pg_ctl`` with its user, data directory and log: ``stop``/``start`` append the action
    pg_ctl: list[str] = dataclasses.field(default_factory=list)
    options: str = ""

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: sessions are cut, as in an outage); its data stays."""
        subprocess.run([*self.pg_ctl, "-m", mode, "-w", "stop"], check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        """Start it again on the same port; returns once it accepts connections."""
        subprocess.run(
            [*self.pg_ctl, "-o", self.options, "-w", "-t", "60", "start"], check=True, capture_output=True, timeout=70
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self, prefix: str = "kvcdn") -> str:
        """A fresh empty database; its URL."""
        import uuid

        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def postgres_bindir() -> Path | None:
    """Where initdb and pg_ctl are: ``$KVCDN_PG_BINDIR``, PATH, or Debian's versioned directory."""
    if os.environ.get("KVCDN_PG_BINDIR"):
        return Path(os.environ["KVCDN_PG_BINDIR"])
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    return versions[-1].parent if versions else None


@contextlib.contextmanager
def postgres(timeout: float = 60.0) -> Iterator[Postgres]:
    """A throw-away PostgreSQL server on a free loopback port (trust auth, no fsync: tests only).

    PostgreSQL refuses to run as root: as root it runs as the ``postgres`` user.
    """
    import pwd
    import tempfile

    bindir = postgres_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    directory = Path(tempfile.mkdtemp(prefix="kvcdn-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(directory, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, log = directory / "data", directory / "server.log"
    port = free_port()
    subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {directory} -c fsync=off -c max_connections=200"
    pg_ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log)]
    subprocess.run(
        [*pg_ctl, "-o", options, "-w", "-t", str(int(timeout)), "start"],
        check=True,
        capture_output=True,
        timeout=timeout + 10,
    )
    try:
        yield Postgres(port, directory, pg_ctl, options)
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "-w", "stop"], capture_output=True, timeout=timeout)
        shutil.rmtree(directory, ignore_errors=True)


@dataclasses.dataclass
class KvcdnServer:
    url: str
    process: subprocess.Popen
    data_dir: Path
    log: list[str]

    def admin_secret(self) -> str:
        return (self.data_dir / "admin-secret").read_text().strip()


def kvcdn_executable() -> list[str]:
    """Run kvcdn with the interpreter running the tests (its console script may not be on PATH)."""
    return [sys.executable, "-m", "kvcdn_core"]


@contextlib.contextmanager
def kvcdn_server(
    data_home: Path,
    args: list[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    port: int | None = None,
    kvcdn: list[str] | None = None,
) -> Iterator[KvcdnServer]:
    """``kvcdn serve`` on a free loopback port (or ``port``: a server started again where its
    clients expect it) with XDG_DATA_HOME=``data_home``; waits for /health. ``kvcdn``: the command
    that runs kvcdn (default: this interpreter's), for a caller whose own environment lacks the
    server (the vLLM benchmarks)."""
    port = port or free_port()
    full_env = dict(os.environ)
    # Inference on the CPU, like the local `kvcdn continue --device cpu` the tests compare with.
    full_env.update(
        {
            "XDG_DATA_HOME": str(data_home),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "KVCDN_INFER_DEVICE": "cpu",
        }
    )
    full_env.update(env or {})
    cmd = [*(kvcdn or kvcdn_executable()), "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + budget(timeout)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvcdn serve exited with {proc.returncode}:\n" + "".join(log))
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvcdn serve did not become healthy:\n" + "".join(log))
            time.sleep(0.1)
        yield KvcdnServer(url, proc, Path(data_home) / "kvcdn" / "server", log)
    finally:
        _stop(proc, grace=10)
