"""The server's own signed blob URLs (local storage): HMAC-SHA256 over op, object, size and expiry."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from kvcdn_server.errors import ApiError
from kvcdn_wire import ErrorCode

OPS = ("put", "get")


class UrlSigner:
    def __init__(self, key: bytes, clock: Callable[[], float] = time.time):
        self.clock = clock  # the store's clock: a URL and its upload expire on the same time
        # A key of its own, derived so that a leak of one purpose's key reveals nothing of another.
        self._key = hmac.new(key, b"kvcdn/blob-url/v1", hashlib.sha256).digest()
        #: the HMAC state after the key, copied for each signature (a grant signs one URL per object)
        self._keyed = hmac.new(self._key, digestmod=hashlib.sha256)

    def signature(self, op: str, obj: str, size: int, expires: int) -> str:
        mac = self._keyed.copy()
        mac.update(f"{op}\n{obj}\n{size}\n{expires}".encode())
        return mac.hexdigest()

    def query(self, op: str, obj: str, size: int, expires: int) -> str:
        """The URL's query: ``op``, ``expires``, ``size`` and ``sig``, in that order. Every value is
        URL-safe as it is (an op of :data:`OPS`, two integers, hex), so it is joined, not encoded."""
        if op not in OPS:
            raise ValueError(op)
        return f"op={op}&expires={expires}&size={size}&sig={self.signature(op, obj, size, expires)}"

    def check(self, op: str, obj: str, params) -> int:
        """Verify a request's ``op/expires/size/sig``; return the signed size or raise 403."""
        try:
            given_op = params["op"]
            expires = int(params["expires"])
            size = int(params["size"])
            sig = str(params["sig"])
        except (KeyError, ValueError, TypeError):
            raise ApiError(403, ErrorCode.INVALID_SIGNATURE, "the URL is not a valid signed URL") from None
        wanted = self.signature(op, obj, size, expires)
        # Compare first, then look at expiry: a tampered URL never learns whether it had expired.
        if not (
            hmac.compare_digest(sig.encode(), wanted.encode())
            and hmac.compare_digest(str(given_op).encode(), op.encode())
        ):
            raise ApiError(403, ErrorCode.INVALID_SIGNATURE, "the URL's signature does not match")
        if self.clock() > expires:
            raise ApiError(403, ErrorCode.URL_EXPIRED, "the signed URL has expired")
        return size
