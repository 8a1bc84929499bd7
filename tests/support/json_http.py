"""A loopback HTTP server that answers as the test says: stand-ins for issuers and odd servers."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: ``answer(method, path, url) -> (status, body)``; the body is JSON-encoded unless it is bytes
Answer = Callable[[str, str, str], "tuple[int, Any]"]


@contextlib.contextmanager
def json_server(answer: Answer) -> Iterator[tuple[str, list[str]]]:
    """Serve ``answer`` on 127.0.0.1; yield ``(base url, paths requested so far)``."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            seen.append(self.path)
            status, body = answer(self.command, self.path.split("?")[0], base)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_PUT = do_DELETE = _reply  # noqa: N815

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield base, seen
    finally:
        server.shutdown()
        server.server_close()
