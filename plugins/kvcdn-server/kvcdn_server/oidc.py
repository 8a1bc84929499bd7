"""Verification of OIDC access tokens (JWTs) against the issuer's JWKS.

Checked: ``alg`` against an allow-list of asymmetric algorithms (so neither ``none`` nor an ``HS*``
token signed with the public key can pass), the header's ``typ``, which must say access token
(``at+jwt``, RFC 9068: an ID token the issuer gave the CLI is signed by the same keys and carries the
same ``aud``, and must not pass as an access token), the ``kid`` against the JWKS (re-fetched at
most once per 30 s when an unknown ``kid`` shows up, so rotation works and junk tokens cannot hammer
the issuer), the signature, ``iss``, ``aud``, ``exp`` and ``sub``.

The keys are fetched from the discovery document's ``jwks_uri`` only when it is on the issuer's
own origin (scheme, host and port): a discovery document cannot send the server to another host,
scheme or port (another service on the issuer's machine could hold keys of its own). Such a
document is logged once per fetch attempt and every token is refused with 401 until it changes.

``iss`` is compared with the issuer exactly as its discovery document states it (a trailing ``/``
included); the configured URL may differ from it only by that trailing ``/``. When a refresh of the
keys fails, the keys already fetched stay in use and the next attempt waits (30 s, doubling up to
5 min), so an issuer that is down neither fails valid tokens nor gets hammered.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

import httpx
import jwt

from kvcdn_server.errors import ApiError, unauthorized
from kvcdn_wire import ErrorCode

log = logging.getLogger("kvcdn.server")
JWKS_TTL = 300.0
UNKNOWN_KID_REFETCH = 30.0
RETRY_MIN = 30.0
RETRY_MAX = 300.0
#: JWT ``typ`` headers of access tokens (RFC 9068 §2.1), compared case-insensitively
ACCESS_TOKEN_TYPES = ("at+jwt", "application/at+jwt")
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass
class TokenClaims:
    subject: str
    issuer: str
    email: str | None
    customer_id: str


def oidc_customer_id(issuer: str, subject: str) -> str:
    """The tenant of an OIDC subject, namespaced by its issuer."""
    return "oidc:" + hashlib.sha256(f"{issuer}\0{subject}".encode()).hexdigest()[:32]


class JwtVerifier:
    def __init__(self, issuer: str, audience: str, algorithms: list[str], leeway: int = 30):
        self.issuer = issuer  # as discovery states it, once fetched
        self.base_url = issuer.rstrip("/")  # only for building URLs
        self.audience = audience
        self.algorithms = list(algorithms)
        self.leeway = leeway
        self._lock = threading.Lock()
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at = float("-inf")
        self._retry_at = float("-inf")  # no refresh before this after a failed one
        self._retry_wait = RETRY_MIN
        self._failure: ApiError | None = None  # why the last fetch failed, while no keys are held

    def _fetch(self) -> None:
        try:
            with httpx.Client(timeout=5.0, follow_redirects=False) as client:
                discovery = client.get(f"{self.base_url}/.well-known/openid-configuration")
                discovery.raise_for_status()
                meta = discovery.json()
                stated = meta.get("issuer")
                if not isinstance(stated, str) or stated.rstrip("/") != self.base_url:
                    raise ValueError("discovery document names another issuer")
                jwks_url = self._jwks_url(meta.get("jwks_uri"))
                if jwks_url is None:
                    log.error(
                        "the issuer %s names jwks_uri %r, which is not on its origin; its tokens are refused",
                        self.base_url,
                        meta.get("jwks_uri"),
                    )
                    raise unauthorized("the issuer's keys are not on its own origin")
                jwks = client.get(jwks_url)
                jwks.raise_for_status()
                keys = {}
                for raw in jwks.json().get("keys", []):
                    if raw.get("use", "sig") != "sig" or "kid" not in raw:
                        continue
                    try:
                        keys[raw["kid"]] = jwt.PyJWK(raw)
                    except jwt.PyJWTError:
                        continue
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ApiError(
                503, ErrorCode.ISSUER_UNAVAILABLE, f"cannot fetch the issuer's keys: {type(exc).__name__}"
            ) from None
        self.issuer = stated
        self._keys = keys
        self._failure = None
        self._fetched_at = time.monotonic()

    def _jwks_url(self, url) -> str | None:
        """The discovery document's ``jwks_uri`` if it is on the issuer's origin, else None."""
        if isinstance(url, str) and _origin(url) is not None and _origin(url) == _origin(self.base_url):
            return url
        return None

    def _key(self, kid: str) -> jwt.PyJWK | None:
        with self._lock:
            now = time.monotonic()
            age = now - self._fetched_at
            due = age > JWKS_TTL or (kid not in self._keys and age > UNKNOWN_KID_REFETCH)
            if due and now >= self._retry_at:
                try:
                    self._fetch()
                    self._retry_wait = RETRY_MIN
                except ApiError as exc:
                    self._retry_at = now + self._retry_wait
                    self._retry_wait = min(self._retry_wait * 2, RETRY_MAX)
                    self._failure = exc
                    if not self._keys:
                        raise
                    log.warning("the issuer's keys could not be refreshed; using the cached ones")
            elif due and not self._keys:
                if self._failure is not None and self._failure.status == 401:
                    raise self._failure
                raise ApiError(503, ErrorCode.ISSUER_UNAVAILABLE, "cannot fetch the issuer's keys (retrying later)")
            return self._keys.get(kid)

    def verify(self, token: str) -> TokenClaims:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise unauthorized("malformed token") from None
        alg = header.get("alg")
        if alg not in self.algorithms:
            raise unauthorized(f"token algorithm '{alg}' is not allowed")
        kind = header.get("typ")
        if not isinstance(kind, str) or kind.lower() not in ACCESS_TOKEN_TYPES:
            raise unauthorized("not an access token (JWT typ must be at+jwt; an ID token is not accepted)")
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise unauthorized("token has no key id")
        key = self._key(kid)
        if key is None:
            raise unauthorized("token signed with an unknown key")
        try:
            claims = jwt.decode(
                token,
                key=key,
                algorithms=[alg],
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise unauthorized("token expired") from None
        except jwt.InvalidAudienceError:
            raise unauthorized("token is for another audience") from None
        except jwt.InvalidIssuerError:
            raise unauthorized("token is from another issuer") from None
        except jwt.PyJWTError as exc:
            raise unauthorized(f"invalid token: {type(exc).__name__}") from None
        subject = claims["sub"]
        if not isinstance(subject, str) or not subject:
            raise unauthorized("token has no subject")
        email = claims.get("email") if isinstance(claims.get("email"), str) else None
        return TokenClaims(subject, self.issuer, email, oidc_customer_id(self.issuer, subject))


def _origin(url: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of an http(s) URL, the port made explicit; None for anything else."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname, port if port is not None else DEFAULT_PORTS[scheme]
