"""Helpers for the hosted *client* tests (tests/hosted/test_client*.py), next to services.py.

- :func:`kvcdn_login_device`: run ``kvcdn login --no-browser`` as a subprocess and play the person
  who opens the printed verification URL, signs in and confirms the code (with httpx).
- :func:`kvcdn_login_browser`: the same for the authorization-code + PKCE flow: the "browser"
  follows the issuer's redirects back to the CLI's loopback listener.
- :class:`CountingReceiver`: a loopback HTTP sink that counts POSTs (a telemetry collector), with an
  optional delay per request.
- :class:`CuttingProxy`: forwards to a ``kvcdn serve`` but cuts blob downloads half-way, to test
  what an interrupted download leaves behind.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tests.support.budget import budget

from .services import ACCOUNTS, _form_action, browser_login


@dataclasses.dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str


def kvcdn_cmd() -> list[str]:
    return [sys.executable, "-m", "kvcdn_core"]


def _login(args: list[str], env: dict[str, str], play_browser, timeout: float) -> CliRun:
    proc = subprocess.Popen(
        [*kvcdn_cmd(), "login", "--no-browser", *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    err_lines: list[str] = []
    browser_error: list[BaseException] = []

    def read_stderr():
        started = False
        for line in iter(proc.stderr.readline, ""):
            err_lines.append(line)
            if not started:
                url = play_browser.url_in(line)
                if url:
                    started = True
                    try:
                        play_browser(url)
                    except BaseException as exc:  # reported by the caller's assertion
                        browser_error.append(exc)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    killer = threading.Timer(budget(timeout), proc.kill)
    killer.start()
    try:
        out = proc.stdout.read()  # stderr belongs to the reader thread
        proc.wait()
    finally:
        killer.cancel()
    reader.join(5)
    if browser_error:
        raise browser_error[0]
    return CliRun(proc.returncode, out, "".join(err_lines))


class _DeviceBrowser:
    def __init__(self, username: str, password: str):
        self.username, self.password = username, password

    @staticmethod
    def url_in(line: str) -> str | None:
        found = re.search(r"\(or open (\S+)\)", line)
        return found.group(1) if found else None

    def __call__(self, url: str) -> None:
        with httpx.Client(follow_redirects=True, timeout=budget(10)) as browser:
            page = browser.get(url)
            action, fields = _form_action(page.text, str(page.url))  # confirm the pre-filled code
            page = browser.post(action, data=fields)
            done = browser_login(browser, page, self.username, self.password)
            if done.status_code >= 400:
                raise AssertionError(f"device approval failed: {done.status_code} {done.text[:200]}")


class _CodeBrowser(_DeviceBrowser):
    @staticmethod
    def url_in(line: str) -> str | None:
        found = re.match(r"^(http://\S+/auth\?\S+)$", line.strip())
        return found.group(1) if found else None

    def __call__(self, url: str) -> None:
        with httpx.Client(follow_redirects=True, timeout=budget(10)) as browser:
            page = browser.get(url)
            done = browser_login(browser, page, self.username, self.password)
            if done.status_code != 200 or "/callback" not in str(done.url):
                raise AssertionError(f"browser login did not reach the loopback: {done.url} {done.text[:200]}")


def kvcdn_login_device(
    env: dict[str, str], username: str = "alice", args: list[str] = (), timeout: float = 60.0
) -> CliRun:
    """``kvcdn login`` through the device flow, approved in a scripted browser."""
    return _login(list(args), env, _DeviceBrowser(username, ACCOUNTS[username]), timeout)


def kvcdn_login_browser(
    env: dict[str, str], username: str = "alice", args: list[str] = (), timeout: float = 60.0
) -> CliRun:
    """``kvcdn login --flow browser`` (auth code + PKCE), signed in by a scripted browser."""
    return _login(["--flow", "browser", *args], env, _CodeBrowser(username, ACCOUNTS[username]), timeout)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # clients that hang up are expected here
        pass


class CountingReceiver:
    """Counts the POSTs it receives (and keeps their bodies); answers 204 after ``delay`` seconds."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.bodies: list[bytes] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.bodies.append(body)
                time.sleep(receiver.delay)
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def count(self) -> int:
        return len(self.bodies)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class CuttingProxy:
    """A reverse proxy to ``upstream`` that sends only half of every blob GET's body, then hangs up
    (after ``stall`` seconds: time for a test to interrupt the client half-way).

    The server signs URLs for its own public URL (never the request's Host), so the proxy rewrites
    that address to its own in JSON answers, as a reverse proxy configured for it would.
    """

    def __init__(self, upstream: str, port: int = 0, cut_prefix: str = "/api/v1/blobs/", stall: float = 0.0):
        self.upstream = upstream.rstrip("/")
        self.cuts = 0
        self.half_sent = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("content-length", "connection", "transfer-encoding")
                }
                with httpx.Client(timeout=budget(60)) as client:
                    upstream = client.request(self.command, proxy.upstream + self.path, headers=headers, content=body)
                data = upstream.content
                if upstream.headers.get("content-type", "").startswith("application/json"):
                    data = data.replace(proxy.upstream.encode(), proxy.url.encode())
                cut = self.command == "GET" and self.path.startswith(cut_prefix) and upstream.status_code == 200
                self.send_response(upstream.status_code)
                for key, value in upstream.headers.items():
                    if key.lower() not in ("content-length", "connection", "transfer-encoding", "content-encoding"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                if cut:
                    self.send_header("Connection", "close")
                self.end_headers()
                if cut:
                    proxy.cuts += 1
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    proxy.half_sent.set()
                    time.sleep(stall)
                    self.close_connection = True
                    return
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _forward

            def log_message(self, *args):
                pass

        self.server = _Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
