"""Object GETs through signed URLs, their bodies read straight into the caller's memory.

A vLLM engine's remote load is tens of MB of chunk bodies per request, and on the engine's machine
the client's CPU per byte bounds it. httpx hands a body over in pieces that h11 has copied at least
once on the way, which the caller then copies into place: 0.59-0.68 ms of CPU per MB on the
benchmark's 2-core machine. The standard library's ``http.client`` reads the body with ``readinto``
straight into the caller's buffer, the kernel's copy only: 0.24-0.25 ms per MB there
(benchmarks/object_get.py). So the data
plane's GETs go through :class:`ObjectReader`, and the API calls stay on httpx.

The URL carries its own credential (the server's signature or a presigned S3 one), so no header
but ``User-Agent`` is sent. TLS is verified with the context httpx would use (``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` or its bundled roots). A proxy set in the environment for the URL's scheme sends
the GET through httpx, which honours it (and ``NO_PROXY``): the fast path connects directly only.
"""

from __future__ import annotations

import http.client
import threading
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit

from kvcdn_core import KvcdnError
from kvcdn_core.store.pack import read_into

#: Statuses that mean the object is gone or the URL no longer grants it: a miss, not an error.
MISSING = (403, 404, 410)
#: Kept-alive connections per host and port (the tier fetches a few chunks at a time).
KEEP_PER_HOST = 8


class ObjectReader:
    """GETs of signed URLs over kept-alive ``http.client`` connections, one request per connection
    at a time. Thread-safe: each GET takes a connection from the pool and gives it back."""

    def __init__(self, fallback: Any, user_agent: str, timeout: float = 60.0, connect_timeout: float = 10.0):
        self._fallback = fallback  # the httpx client: GETs that must go through a proxy
        self._headers = {"User-Agent": user_agent}
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._tls: Any = None
        self._closed = False
        self._proxies = urllib.request.getproxies()  # read once, as httpx reads them

    def get(
        self, url: str, into: memoryview | None = None, landed: Callable[[int], None] | None = None
    ) -> bytes | memoryview | None:
        """The object's body, read into ``into`` when given, ``landed`` told as its bytes arrive
        (see :func:`kvcdn_core.store.pack.read_into`); None when the URL answers 403, 404 or 410."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KvcdnError(f"a chunk's URL is not an http(s) URL (scheme '{parts.scheme}')")
        if _proxied(parts, self._proxies):
            return self._through_fallback(url, into, landed)
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        while True:
            connection, kept = self._take(key)
            try:
                connection.request("GET", target, headers=self._headers)
                response = connection.getresponse()
            except (ConnectionError, http.client.BadStatusLine):
                connection.close()
                if kept:  # the server closed it while it was idle: again, on another
                    continue
                raise
            except (http.client.InvalidURL, UnicodeError):  # a URL http.client will not send as it is
                connection.close()
                return self._through_fallback(url, into, landed)  # httpx encodes it (no error repeats the URL)
            except BaseException:
                connection.close()
                raise
            break
        try:
            body = _body(response, into, landed)
        except BaseException:
            connection.close()
            raise
        if response.status == 200 and not response.will_close:
            self._give(key, connection)
        else:
            connection.close()
        return body

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _take(self, key: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        """A kept connection to ``key`` (True), or a new one, connected (False)."""
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), True
        scheme, host, port = key
        connection: http.client.HTTPConnection
        if scheme == "https":
            connection = http.client.HTTPSConnection(host, port, timeout=self._connect_timeout, context=self._context())
        else:
            connection = http.client.HTTPConnection(host, port, timeout=self._connect_timeout)
        try:
            connection.connect()
        except BaseException:
            connection.close()
            raise
        assert connection.sock is not None
        connection.sock.settimeout(self._timeout)
        return connection, False

    def _give(self, key: tuple[str, str, int], connection: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < KEEP_PER_HOST:
                idle.append(connection)
                return
        connection.close()

    def _context(self) -> Any:
        with self._lock:
            if self._tls is None:
                import httpx

                self._tls = httpx.create_ssl_context()  # the verification the API calls get
            return self._tls

    def _through_fallback(
        self, url: str, into: memoryview | None, landed: Callable[[int], None] | None
    ) -> bytes | memoryview | None:
        with self._fallback.stream("GET", url) as response:
            if _missing(response.status_code):
                return None
            if into is None:
                return response.read()
            return read_into(response.iter_bytes(), into, landed)


def _body(
    response: http.client.HTTPResponse, into: memoryview | None, landed: Callable[[int], None] | None
) -> bytes | memoryview | None:
    """A 200's body (into ``into`` when given); None for a missing object; one error line else.
    The body of any other status is not read: its connection is closed, not kept."""
    if _missing(response.status):
        return None
    declared = response.length  # None: a chunked transfer
    early = "a chunk's body ended early" + ("" if declared is None else f" (it declared {declared} bytes)")
    try:
        data = response.read() if into is None else read_into(response, into, landed)
    except http.client.IncompleteRead:
        raise KvcdnError(early) from None
    if declared is not None and response.length:  # readinto ends at the stream's end without a word
        raise KvcdnError(early)
    return data


def _missing(status: int) -> bool:
    """True for a missing object (403, 404, 410), False for a 200; one error line for any other."""
    if status in MISSING:
        return True
    if status != 200:
        raise KvcdnError(f"GET of a chunk failed ({status})")
    return False


def _proxied(parts: SplitResult, proxies: dict[str, str]) -> bool:
    """Whether the environment names a proxy for this URL's scheme (``HTTP(S)_PROXY`` or
    ``ALL_PROXY``). ``NO_PROXY`` is left to httpx, whose reading of it differs from the standard
    library's (``.example.com``): with a proxy set, every GET goes through httpx."""
    return bool(proxies.get(parts.scheme) or proxies.get("all"))
