"""Token type and key discovery (issue 13, item 7): an ID token is not an access token, and a
discovery document cannot send the server's key fetch to another host or scheme."""

from __future__ import annotations

import contextlib

import httpx
import jwt
import pytest

from kvcdn_server.errors import ApiError
from kvcdn_server.oidc import JwtVerifier
from tests.support import services
from tests.support.hosted import API, bearer
from tests.support.json_http import json_server


def test_an_id_token_from_the_real_issuer_is_not_an_access_token(local_server, oidc_issuer):
    tokens = services.device_flow_token(oidc_issuer.url, "alice", scope="openid email kvcdn")
    id_token, access_token = tokens["id_token"], tokens["access_token"]
    # Same issuer, same keys, same audience: only the token type tells them apart.
    assert jwt.get_unverified_header(access_token)["typ"] == "at+jwt"
    assert jwt.decode(id_token, options={"verify_signature": False})["aud"] == "kvcdn-cli"
    assert httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(access_token)).status_code == 200
    r = httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(id_token))
    assert r.status_code == 401 and "not an access token" in r.json()["message"], r.text


@pytest.fixture
def discovery():
    """``discovery(jwks_uri) -> (issuer url, paths requested)``: a loopback issuer naming that jwks_uri."""
    with contextlib.ExitStack() as stack:

        def start(jwks_uri: str):
            def answer(_method, path, base):
                if path == "/.well-known/openid-configuration":
                    return 200, {"issuer": base, "jwks_uri": jwks_uri.format(port=base.rsplit(":", 1)[1])}
                return (200, {"keys": []}) if path == "/jwks" else (404, {})

            return stack.enter_context(json_server(answer))

        yield start


def _token() -> str:
    """A well-formed RS256 access-token header, so verification reaches the key fetch."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return jwt.encode({"sub": "x"}, key, algorithm="RS256", headers={"kid": "k1", "typ": "at+jwt"})


@pytest.mark.parametrize(
    "jwks_uri",
    [
        "http://localhost:{port}/jwks",  # same machine, another host name
        "https://keys.example.test/jwks",  # another host
        "file:///etc/passwd",  # another scheme
        "ftp://127.0.0.1:{port}/jwks",  # another scheme on the issuer's host
        "//127.0.0.1:{port}/jwks",  # no scheme
    ],
)
def test_jwks_uri_off_the_issuer_host_is_never_fetched(discovery, jwks_uri):
    issuer, requests = discovery(jwks_uri)
    verifier = JwtVerifier(issuer, "kvcdn-cli", ["RS256"])
    with pytest.raises(ApiError) as caught:
        verifier.verify(_token())
    assert caught.value.status == 503 and caught.value.code == "issuer_unavailable"
    assert requests == ["/.well-known/openid-configuration"]


def test_jwks_uri_on_the_loopback_issuer_is_fetched(discovery):
    issuer, requests = discovery("http://127.0.0.1:{port}/jwks")
    verifier = JwtVerifier(issuer, "kvcdn-cli", ["RS256"])
    with pytest.raises(ApiError) as caught:
        verifier.verify(_token())
    assert caught.value.status == 401  # the keys were fetched: the kid is just not among them
    assert requests == ["/.well-known/openid-configuration", "/jwks"]


def test_an_id_token_shaped_header_is_refused_before_any_key_fetch(discovery):
    from cryptography.hazmat.primitives.asymmetric import rsa

    issuer, requests = discovery("http://127.0.0.1:{port}/jwks")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for headers in ({"kid": "k1"}, {"kid": "k1", "typ": "JWT"}, {"kid": "k1", "typ": ["at+jwt"]}):
        token = jwt.encode({"sub": "x"}, key, algorithm="RS256", headers=headers)
        with pytest.raises(ApiError) as caught:
            JwtVerifier(issuer, "kvcdn-cli", ["RS256"]).verify(token)
        assert caught.value.status == 401 and "not an access token" in caught.value.message
    assert requests == []
