"""The server's signed blob URLs: the query a grant carries is the URL-encoded HMAC of op, object,
size and expiry under the derived key, exactly as before it was made cheaper (one keyed HMAC state
copied per URL, the query joined rather than encoded): URLs signed by an older server still check."""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qsl, urlencode

import pytest

from kvcdn_server.errors import ApiError
from kvcdn_server.signing import UrlSigner


def test_a_signed_query_is_the_encoded_hmac_and_checks():
    key = b"k" * 32
    signer = UrlSigner(key, clock=lambda: 1_000)
    derived = hmac.new(key, b"kvcdn/blob-url/v1", hashlib.sha256).digest()
    cases = [("get", "chunks/" + "ab" * 32, 65536, 5_000), ("put", "uploads/x/y", 0, 1_001), ("get", "a b/c", 7, 2_000)]
    queries = []
    for op, obj, size, expires in cases:
        sig = hmac.new(derived, f"{op}\n{obj}\n{size}\n{expires}".encode(), hashlib.sha256).hexdigest()
        query = signer.query(op, obj, size, expires)
        assert query == urlencode({"op": op, "expires": expires, "size": size, "sig": sig})
        assert signer.check(op, obj, dict(parse_qsl(query))) == size
        queries.append(query)
    assert len({q.rpartition("sig=")[2] for q in queries}) == len(cases)  # no state shared between signatures
    op, obj, size, expires = cases[0]
    with pytest.raises(ApiError):  # another object's URL
        signer.check(op, "chunks/" + "cd" * 32, dict(parse_qsl(queries[0])))
    with pytest.raises(ValueError):
        signer.query("delete", obj, size, expires)
