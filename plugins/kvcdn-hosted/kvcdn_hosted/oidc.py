"""OIDC login for a command-line client: device authorization grant, else auth code + PKCE.

* Discovery: ``<issuer>/.well-known/openid-configuration``, whose ``issuer`` must equal ours.
* Device authorization grant (RFC 8628) when the issuer advertises it: the verification URL and user
  code are always printed (a browser may not open, or may be on another machine); polling honours
  ``interval``, adds 5 s on ``slow_down`` and gives up at ``expires_in``.
* Otherwise authorization code + PKCE (S256, RFC 7636) with a one-shot loopback redirect
  (RFC 8252): ``state`` is checked and the wait is bounded.
* Sessions are refreshed with the refresh token shortly before the access token expires.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from kvcdn_core import KvcdnError

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
DEFAULT_SCOPE = "openid offline_access"
#: refresh when the access token has less than this left
REFRESH_MARGIN_S = 60
HTTP_TIMEOUT = 15.0


def _json(response, what: str) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise KvcdnError(f"{what}: the issuer answered HTTP {response.status_code} without a JSON object")
    return data


def _oauth_error(data: dict[str, Any], what: str, status: int) -> KvcdnError:
    code = data.get("error") or f"HTTP {status}"
    description = data.get("error_description")
    return KvcdnError(f"{what}: {code}" + (f" ({description})" if description else ""))


def discover(http, issuer: str) -> dict[str, Any]:
    """The issuer's metadata, checked to really be that issuer's."""
    import httpx

    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    try:
        response = http.get(url, timeout=HTTP_TIMEOUT)
    except httpx.HTTPError as exc:
        raise KvcdnError(f"cannot reach the OIDC issuer at {url}: {exc}") from None
    if response.status_code != 200:
        raise KvcdnError(f"OIDC discovery at {url} answered HTTP {response.status_code}")
    meta = _json(response, f"OIDC discovery at {url}")
    if str(meta.get("issuer", "")).rstrip("/") != issuer.rstrip("/"):
        raise KvcdnError(f"OIDC discovery at {url} names issuer '{meta.get('issuer')}', not '{issuer}'")
    if not meta.get("token_endpoint"):
        raise KvcdnError(f"OIDC discovery at {url} has no token_endpoint")
    return meta


def _base_params(client_id: str, scope: str, resource: str | None) -> dict[str, str]:
    params = {"client_id": client_id, "scope": scope}
    if resource:
        params["resource"] = resource
    return params


def device_login(
    http,
    meta: dict[str, Any],
    client_id: str,
    *,
    scope: str = DEFAULT_SCOPE,
    resource: str | None = None,
    say: Callable[[str], None],
    open_browser: Callable[[str], Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Run the device authorization grant; return the token response."""
    response = http.post(
        meta["device_authorization_endpoint"], data=_base_params(client_id, scope, resource), timeout=HTTP_TIMEOUT
    )
    data = _json(response, "device authorization request")
    if response.status_code != 200:
        raise _oauth_error(data, "the issuer refused the device authorization request", response.status_code)
    for key in ("device_code", "user_code", "verification_uri"):
        if not data.get(key):
            raise KvcdnError(f"device authorization response lacks '{key}'")
    expires_in = float(data.get("expires_in") or 600)
    interval = float(data.get("interval") or 5)
    deadline = clock() + expires_in
    say(f"To log in, open {data['verification_uri']} and enter the code: {data['user_code']}")
    complete = data.get("verification_uri_complete")
    if complete:
        say(f"(or open {complete})")
    if open_browser is not None:
        try:
            open_browser(complete or data["verification_uri"])
        except Exception:
            pass
    say(f"Waiting for approval (the code expires in {int(expires_in)} s)...")
    while True:
        if clock() + interval > deadline:
            sleep(max(0.0, deadline - clock()))
            raise KvcdnError("the login code expired before it was approved; run kvcdn login again")
        sleep(interval)
        response = http.post(
            meta["token_endpoint"],
            timeout=HTTP_TIMEOUT,
            data={"grant_type": DEVICE_GRANT, "device_code": data["device_code"], "client_id": client_id},
        )
        tokens = _json(response, "device token request")
        if response.status_code == 200:
            return tokens
        error = tokens.get("error")
        if error == "authorization_pending":
            continue
        if error == "slow_down":
            interval += 5  # RFC 8628 §3.5: for this and every later request
            continue
        if error == "access_denied":
            raise KvcdnError("login was denied in the browser")
        if error == "expired_token":
            raise KvcdnError("the login code expired before it was approved; run kvcdn login again")
        raise _oauth_error(tokens, "login failed", response.status_code)


def pkce_pair() -> tuple[str, str]:
    """``(code_verifier, S256 code_challenge)``."""
    verifier = secrets.token_urlsafe(48)  # 64 characters of [A-Za-z0-9_-]
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


class _Callback(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        parsed = urllib.parse.urlsplit(self.path)
        if parsed.path != "/callback":
            self.send_error(404)
            return
        query = dict(urllib.parse.parse_qsl(parsed.query))
        self.server.callback_result = query
        ok = "code" in query and "error" not in query
        body = (
            "Login complete: you can close this window and return to the terminal."
            if ok
            else "Login failed: return to the terminal for details."
        ).encode()
        self.send_response(200 if ok else 400)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep the terminal clean
        pass


def pkce_login(
    http,
    meta: dict[str, Any],
    client_id: str,
    *,
    scope: str = DEFAULT_SCOPE,
    resource: str | None = None,
    timeout_s: float = 300.0,
    say: Callable[[str], None],
    open_browser: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """Authorization code + PKCE on a loopback redirect; return the token response."""
    if not meta.get("authorization_endpoint"):
        raise KvcdnError("the issuer offers neither the device flow nor an authorization endpoint")
    methods = meta.get("code_challenge_methods_supported")
    if methods is not None and "S256" not in methods:
        raise KvcdnError("the issuer does not support PKCE with S256; refusing a login without it")
    verifier, challenge = pkce_pair()
    state = secrets.token_urlsafe(24)
    server = HTTPServer(("127.0.0.1", 0), _Callback)
    server.callback_result = None  # type: ignore[attr-defined]
    redirect_uri = f"http://127.0.0.1:{server.server_address[1]}/callback"
    params = _base_params(client_id, scope, resource)
    params.update(
        response_type="code",
        redirect_uri=redirect_uri,
        state=state,
        code_challenge=challenge,
        code_challenge_method="S256",
    )
    if "offline_access" in scope.split():
        params["prompt"] = "consent"  # OIDC Core §11: a refresh token is granted only with consent
    separator = "&" if "?" in meta["authorization_endpoint"] else "?"
    url = meta["authorization_endpoint"] + separator + urllib.parse.urlencode(params)
    say(f"To log in, open this URL in a browser on this machine:\n{url}")
    if open_browser is not None:
        try:
            open_browser(url)
        except Exception:
            pass
    say(f"Waiting for the browser to come back to {redirect_uri} (at most {int(timeout_s)} s)...")
    deadline = time.monotonic() + timeout_s
    try:
        while server.callback_result is None:  # type: ignore[attr-defined]
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvcdnError(f"login timed out after {int(timeout_s)} s waiting for the browser")
            server.timeout = min(left, 1.0)
            server.handle_request()
    finally:
        server.server_close()
    query: dict[str, str] = server.callback_result  # type: ignore[attr-defined]
    if query.get("error"):
        raise _oauth_error(query, "login failed in the browser", 400)
    if not secrets.compare_digest(query.get("state", ""), state):
        raise KvcdnError("login aborted: the redirect's state does not match (a forged or stale redirect)")
    if query.get("iss") and query["iss"].rstrip("/") != str(meta.get("issuer", "")).rstrip("/"):
        raise KvcdnError(f"login aborted: the redirect comes from issuer '{query['iss']}', not ours (RFC 9207)")
    if not query.get("code"):
        raise KvcdnError("login failed: the redirect carries no authorization code")
    data = {
        "grant_type": "authorization_code",
        "code": query["code"],
        "redirect_uri": redirect_uri,
        "client_id": client_id,
        "code_verifier": verifier,
    }
    if resource:
        data["resource"] = resource
    response = http.post(meta["token_endpoint"], data=data, timeout=HTTP_TIMEOUT)
    tokens = _json(response, "token request")
    if response.status_code != 200:
        raise _oauth_error(tokens, "the issuer refused the authorization code", response.status_code)
    return tokens


def session_from_tokens(
    tokens: dict[str, Any],
    meta: dict[str, Any],
    issuer: str,
    client_id: str,
    resource: str | None,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What is stored for a login: tokens plus where and how to refresh them."""
    if not tokens.get("access_token"):
        raise KvcdnError("the issuer's token response has no access_token")
    previous = previous or {}
    expires_in = tokens.get("expires_in")
    return {
        "issuer": issuer,
        "client_id": client_id,
        "resource": resource,
        "token_endpoint": meta.get("token_endpoint") or previous.get("token_endpoint"),
        "revocation_endpoint": meta.get("revocation_endpoint") or previous.get("revocation_endpoint"),
        "access_token": tokens["access_token"],
        # issuers that rotate refresh tokens send a new one; the others keep the old one valid
        "refresh_token": tokens.get("refresh_token") or previous.get("refresh_token"),
        "expires_at": time.time() + float(expires_in) if expires_in else None,
        "scope": tokens.get("scope") or previous.get("scope"),
    }


def needs_refresh(session: dict[str, Any], margin_s: float = REFRESH_MARGIN_S) -> bool:
    expires_at = session.get("expires_at")
    return expires_at is not None and float(expires_at) - time.time() < margin_s


def refresh(http, session: dict[str, Any]) -> dict[str, Any]:
    """A new session from the refresh token, or a one-line error that says to log in again."""
    import httpx

    if not session.get("refresh_token"):
        raise KvcdnError("your login session expired and has no refresh token: run kvcdn login")
    data = {"grant_type": "refresh_token", "refresh_token": session["refresh_token"], "client_id": session["client_id"]}
    if session.get("resource"):
        data["resource"] = session["resource"]
    try:
        response = http.post(session["token_endpoint"], data=data, timeout=HTTP_TIMEOUT)
    except httpx.HTTPError as exc:
        raise KvcdnError(f"cannot refresh the login session at {session['token_endpoint']}: {exc}") from None
    tokens = _json(response, "token refresh")
    if response.status_code != 200:
        error = tokens.get("error") or f"HTTP {response.status_code}"
        raise KvcdnError(f"your login session could not be refreshed ({error}): run kvcdn login")
    return session_from_tokens(
        tokens, {}, session["issuer"], session["client_id"], session.get("resource"), previous=session
    )


def revoke(http, session: dict[str, Any]) -> bool:
    """Best-effort revocation of the refresh token at logout (RFC 7009)."""
    endpoint, token = session.get("revocation_endpoint"), session.get("refresh_token")
    if not endpoint or not token:
        return False
    try:
        response = http.post(
            endpoint,
            timeout=5.0,
            data={"token": token, "token_type_hint": "refresh_token", "client_id": session["client_id"]},
        )
        return response.status_code == 200
    except Exception:
        return False
