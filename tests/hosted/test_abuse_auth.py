"""Token type and key discovery (issue 13, item 7; issue 26, item 4): an ID token is not an access
token, and a discovery document cannot send the server's key fetch to another host, scheme or port."""

from __future__ import annotations

import contextlib

import httpx
import jwt
import pytest

from kvcdn_server.errors import ApiError
from kvcdn_server.oidc import JwtVerifier
from tests.support import services
from tests.support.budget import wait_until
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
        "https://127.0.0.1:{port}/jwks",  # the issuer's host and port, another scheme
        "http://127.0.0.1:1{port}/jwks",  # the issuer's host, a port that is no port
    ],
)
def test_jwks_uri_off_the_issuer_host_is_never_fetched(discovery, jwks_uri):
    issuer, requests = discovery(jwks_uri)
    verifier = JwtVerifier(issuer, "kvcdn-cli", ["RS256"])
    with pytest.raises(ApiError) as caught:
        verifier.verify(_token())
    # Not "unavailable" (a retry would not help): the issuer's keys cannot be trusted.
    assert caught.value.status == 401 and "origin" in caught.value.message
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


@pytest.fixture
def port_hopping_issuer():
    """Issue 26, item 4: a loopback issuer whose discovery names a JWKS on *another port* of its own
    host, served by a second real HTTP server holding the attacker's key. Yields ``(issuer url, a
    token signed by that key with every claim right, paths the key server was asked for)``."""
    import time

    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    jwk.update(kid="hop", use="sig", alg="RS256")
    keys_answer = lambda _m, path, _b: (200, {"keys": [jwk]}) if path == "/jwks" else (404, {})  # noqa: E731
    with json_server(keys_answer) as (keys_base, keys_seen):

        def issuer_answer(_method, path, base):
            if path == "/.well-known/openid-configuration":
                return 200, {"issuer": base, "jwks_uri": f"{keys_base}/jwks"}  # same host, other port
            return 404, {}

        with json_server(issuer_answer) as (issuer, _seen):
            claims = {"sub": "mallory", "iss": issuer, "aud": "kvcdn-cli", "exp": int(time.time()) + 600}
            token = jwt.encode(claims, key, algorithm="RS256", headers={"kid": "hop", "typ": "at+jwt"})
            yield issuer, token, keys_seen


def test_jwks_on_another_port_of_the_issuer_host_is_refused(port_hopping_issuer, caplog):
    issuer, token, keys_seen = port_hopping_issuer
    verifier = JwtVerifier(issuer, "kvcdn-cli", ["RS256"])
    with caplog.at_level("ERROR", logger="kvcdn.server"):
        for _ in range(2):  # the second token is refused from the remembered failure, no fetch
            with pytest.raises(ApiError) as caught:
                verifier.verify(token)
            assert caught.value.status == 401 and "origin" in caught.value.message, caught.value.message
    assert keys_seen == []
    lines = [r.getMessage() for r in caplog.records if "jwks_uri" in r.getMessage()]
    assert len(lines) == 1 and issuer in lines[0], lines


def test_a_server_refuses_tokens_whose_issuer_points_its_keys_elsewhere(port_hopping_issuer, tmp_path):
    issuer, token, keys_seen = port_hopping_issuer
    with services.kvcdn_server(tmp_path, [], {"KVCDN_ISSUER_URL": issuer}) as server:
        r = httpx.get(f"{server.url}{API}/whoami", headers=bearer(token))
        assert r.status_code == 401, r.text
        assert keys_seen == []
        # the server's log reaches the test through a reader thread: wait for the line, do not race it
        wait_until(lambda: any("jwks_uri" in line for line in server.log), 30)
