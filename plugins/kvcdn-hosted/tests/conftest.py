"""Fixtures for the client's unit tests: an isolated config home, small `.kv` files, and a small
local HTTP receiver whose routes each test writes (for what a full `kvcdn serve` cannot be made to
do on demand: a connection cut half-way, a 503, a slow_down, a slow telemetry sink)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    """An empty ``$XDG_CONFIG_HOME`` and no ``KVCDN_*`` variables from the caller's shell."""
    home = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    for name in (
        "KVCDN_API_URL",
        "KVCDN_ISSUER_URL",
        "KVCDN_CLIENT_ID",
        "KVCDN_DEFAULT_ORG",
        "KVCDN_DEFAULT_PROJECT",
        "KVCDN_API_KEY",
        "KVCDN_TELEMETRY",
        "KVCDN_ADMIN_SECRET",
        "KVCDN_OIDC_RESOURCE",
    ):
        monkeypatch.delenv(name, raising=False)
    return home / "kvcdn"


def write_kv(path: Path, tokens: int = 8, seed: int = 0) -> Path:
    """A small but complete `.kv` artifact (2 full-attention layers), written by core's writer."""
    import torch

    from kvcdn_core import artifact

    g = torch.Generator().manual_seed(seed)
    tensors = {"token_ids": torch.arange(tokens, dtype=torch.int64)}
    layers = []
    for i in range(2):
        k, v = f"layers.{i}.key", f"layers.{i}.value"
        tensors[k] = torch.randn(1, 2, tokens, 8, generator=g)
        tensors[v] = torch.randn(1, 2, tokens, 8, generator=g)
        layers.append({"index": i, "kind": "full_attention", "tensors": {"key": k, "value": v}})
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00Z",
        "model": {"id": "tiny/test", "architecture": "Qwen3ForCausalLM", "family": "qwen"},
        "compute_dtype": "float32",
        "layers": layers,
    }
    return artifact.write_artifact(path, manifest, tensors)


@pytest.fixture
def kv_file(tmp_path):
    return write_kv(tmp_path / "doc.kv")


class Receiver:
    """A loopback HTTP server: ``routes[(METHOD, path)] = fn(handler) -> (status, headers, body)``.

    ``requests`` records ``(method, path, headers, body)`` of every request received.
    """

    def __init__(self):
        self.routes = {}
        self.requests = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?")[0]
                receiver.requests.append((self.command, self.path, dict(self.headers), body))
                fn = receiver.routes.get((self.command, path))
                if fn is None:
                    status, headers, payload = 404, {}, {"error": "not_found", "message": f"no route {path}"}
                else:
                    self.body = body
                    result = fn(self)
                    if result is None:  # the route wrote the response itself
                        return
                    status, headers, payload = result
                if isinstance(payload, (dict, list)):
                    payload = json.dumps(payload).encode()
                    headers = {"Content-Type": "application/json", **headers}
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that hung up on purpose
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def count(self, method: str, path: str) -> int:
        return sum(1 for m, p, _h, _b in self.requests if m == method and p.split("?")[0] == path)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()
