"""Token type and key discovery (issue 13, item 7): an ID token is not an access token, and a
discovery document cannot send the server's key fetch to another host or scheme."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import jwt
import pytest

from kvcdn_server.errors import ApiError
from kvcdn_server.oidc import JwtVerifier
from tests.support import services
from tests.support.hosted import API, bearer


def test_an_id_token_from_the_real_issuer_is_not_an_access_token(local_server, oidc_issuer):
    tokens = services.device_flow_token(oidc_issuer.url, "alice", scope="openid email kvcdn")
    id_token, access_token = tokens["id_token"], tokens["access_token"]
    # Same issuer, same keys, same audience: only the token type tells them apart.
    assert jwt.get_unverified_header(access_token)["typ"] == "at+jwt"
    assert jwt.decode(id_token, options={"verify_signature": False})["aud"] == "kvcdn-cli"
    assert httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(access_token)).status_code == 200
    r = httpx.get(f"{local_server.url}{API}/whoami", headers=bearer(id_token))
    assert r.status_code == 401 and "not an access token" in r.json()["message"], r.text


class _Discovery(BaseHTTPRequestHandler):
    """An issuer whose discovery document names ``jwks_uri`` as the test says; records requests."""

    jwks_uri = ""
    requests: list[str] = []

    def do_GET(self):  # noqa: N802
        type(self).requests.append(self.path)
        if self.path == "/.well-known/openid-configuration":
            host, port = self.server.server_address[:2]
            body = json.dumps({"issuer": f"http://{host}:{port}",
                               "jwks_uri": self.jwks_uri.format(port=port)}).encode()
        elif self.path == "/jwks":
            body = json.dumps({"keys": []}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def discovery():
    """``discovery(jwks_uri) -> (issuer url, requests seen)``: a loopback issuer naming that jwks_uri."""
    servers = []

    def start(jwks_uri: str) -> str:
        handler = type("Handler", (_Discovery,), {"jwks_uri": jwks_uri, "requests": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append((server, handler))
        return f"http://127.0.0.1:{server.server_address[1]}", handler.requests

    yield start
    for server, _ in servers:
        server.shutdown()
        server.server_close()


def _token() -> str:
    """A well-formed RS256 access-token header, so verification reaches the key fetch."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return jwt.encode({"sub": "x"}, key, algorithm="RS256", headers={"kid": "k1", "typ": "at+jwt"})


@pytest.mark.parametrize("jwks_uri", [
    "http://localhost:{port}/jwks",          # same machine, another host name
    "https://keys.example.test/jwks",        # another host
    "file:///etc/passwd",                    # another scheme
    "ftp://127.0.0.1:{port}/jwks",           # another scheme on the issuer's host
    "//127.0.0.1:{port}/jwks",               # no scheme
])
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
