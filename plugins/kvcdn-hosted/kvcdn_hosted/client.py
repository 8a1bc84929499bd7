"""Talking to the hosted API: which credential to send, retries, and one-line errors.

Credential precedence: an API key (flag, ``KVCDN_API_KEY``, config, stored with ``kvcdn api-key
set``) wins over a login session; a session is refreshed shortly before its access token expires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar

from kvcdn_core import KvcdnError, warn
from kvcdn_hosted import credentials, oidc
from kvcdn_hosted.apikey import validate_api_key
from kvcdn_hosted.config import Settings
from kvcdn_wire import NOT_DONE_UNAVAILABLE

if TYPE_CHECKING:
    from kvcdn_hosted.objects import ObjectReader
    from kvcdn_wire.responses import Answer

    A = TypeVar("A", bound=Answer)

#: statuses worth another try: rate limited, and the usual proxy/restart answers
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
#: what may be retried of a request that is not idempotent: answers that say it was not processed
UNPROCESSED_STATUSES = frozenset({429})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
ATTEMPTS = 4
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
#: how long one request of a caller that cannot wait (the engine's scheduler, :meth:`request`
#: with ``attempts=1``) waits for the service, in seconds: a miss there only costs recompute
IMPATIENT_TIMEOUT_S = 2.0
LOGIN_HINT = "log in with `kvcdn login` or set an API key with `kvcdn api-key set KEY` (or KVCDN_API_KEY)"


class ServiceTimeout(KvcdnError, TimeoutError):
    """The service did not answer in time (on the last attempt): a ``TimeoutError`` too, so a
    caller that backs off from a slow service needs nothing of this module to tell it apart."""


@dataclasses.dataclass
class Credential:
    method: str  # api_key | oidc
    token: str
    source: str  # where it came from, for whoami
    expires_at: float | None = None


def resolve_credential(settings: Settings, http=None) -> Credential | None:
    """The credential to send, refreshing a login session that is about to expire."""
    if settings.api_key:
        key = validate_api_key(settings.api_key)
        return Credential("api_key", key, settings.sources.get("api_key", "settings"))
    stored = credentials.load()
    if stored.get("api_key"):
        return Credential("api_key", validate_api_key(stored["api_key"]), f"stored {credentials.credentials_path()}")
    session = stored.get("session")
    if not session:
        return None
    if settings.issuer_url and session.get("issuer") != settings.issuer_url:
        return None  # a session of another issuer is no credential for this one
    if oidc.needs_refresh(session):
        session = _refreshed(session, http)
    return Credential(
        "oidc", session["access_token"], f"login session ({session['issuer']})", session.get("expires_at")
    )


def _refreshed(session: dict[str, Any], http=None) -> dict[str, Any]:
    """The session refreshed, under the credentials' lock: another process may have done it already."""
    import httpx

    with credentials.locked():
        current = credentials.load().get("session")
        if isinstance(current, dict) and current.get("issuer") == session.get("issuer"):
            session = current  # the latest refresh token, possibly rotated by another process
        if not oidc.needs_refresh(session):
            return session
        with httpx.Client() if http is None else contextlib.nullcontext(http) as client:
            session = oidc.refresh(client, session)
        credentials.update(session=session)
    return session


def backoff_delay(attempt: int, retry_after: str | None = None) -> float:
    """Exponential backoff with jitter; a server's ``Retry-After`` (seconds) is honoured up to the cap."""
    if retry_after:
        try:
            return min(max(float(retry_after), 0.0), BACKOFF_MAX_S)
        except ValueError:
            pass
    return min(BACKOFF_BASE_S * (2**attempt), BACKOFF_MAX_S) * (0.5 + random.random() / 2)


def server_message(response) -> str:
    """What the server said, in one line: a kvcdn refusal's ``message`` (an :class:`ErrorBody`); any
    other body (a storage's XML, a proxy's page) as its text, cut short; else the status text."""
    from kvcdn_wire.responses import ErrorBody, parse

    try:
        message = parse(ErrorBody, response.json()).message
    except ValueError:  # no JSON, or JSON of another shape (pydantic's ValidationError is a ValueError)
        message = ""
    if message.strip():
        return " ".join(message.split())
    text = " ".join((response.text or "").split())[:200]
    return text or response.reason_phrase or "no details"


def speaks_kvcdn(response) -> bool:
    """A kvcdn server answers every error with a JSON object naming it; a web server, a proxy's
    error page or a login portal does not, and its page is no error message."""
    try:
        data = response.json()
    except ValueError:
        return False
    return isinstance(data, dict) and any(k in data for k in ("error", "message", "detail"))


def not_kvcdn(response, what: str) -> KvcdnError:
    url = str(response.request.url).split("?", 1)[0]  # the query (a cursor, a signature) is no help here
    return KvcdnError(f"{what}: not a kvcdn server (HTTP {response.status_code} from {url})")


def raise_for_response(response, what: str) -> None:
    status = response.status_code
    if status < 400:
        return
    if not speaks_kvcdn(response):
        raise not_kvcdn(response, what)
    message = server_message(response)
    if status == 401:
        raise KvcdnError(f"{what}: not authenticated ({message}); {LOGIN_HINT}")
    if status == 403:
        raise KvcdnError(f"{what}: forbidden ({message})")
    raise KvcdnError(f"{what}: the server answered {status}: {message}")


class HostedClient:
    """An httpx client for one endpoint with one credential."""

    def __init__(self, settings: Settings, *, auth: bool = True, credential: Credential | None = None):
        import httpx

        self.settings = settings
        self.api_url = settings.require_api_url()
        self.http = httpx.Client(
            timeout=httpx.Timeout(60.0, connect=10.0), follow_redirects=False, headers={"User-Agent": _user_agent()}
        )
        self.credential = credential
        if auth and credential is None:
            self.credential = resolve_credential(settings, self.http)
        self._objects: ObjectReader | None = None
        self._objects_lock = threading.Lock()

    @property
    def objects(self) -> ObjectReader:
        """The GETs of signed object URLs (chunk bodies), read straight into memory
        (:mod:`kvcdn_hosted.objects`)."""
        with self._objects_lock:
            if self._objects is None:
                from kvcdn_hosted.objects import ObjectReader

                self._objects = ObjectReader(self.http, _user_agent())
            return self._objects

    def close(self) -> None:
        self.http.close()
        if self._objects is not None:
            self._objects.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def url(self, path_or_url: str) -> str:
        """An absolute URL; a server-relative one (``/api/...``) is joined to the endpoint."""
        if path_or_url.startswith(("http://", "https://")):
            return path_or_url
        return self.api_url + "/" + path_or_url.lstrip("/")

    def headers(self, auth: bool = True) -> dict[str, str]:
        if auth and self.credential is not None:
            return {"Authorization": f"Bearer {self.credential.token}"}
        return {}

    def _warn_plain_http(self) -> None:
        """Warn once when a credential is about to cross the network unencrypted."""
        if self.credential is None or self.api_url in _warned_plain_http:
            return
        if insecure_remote(self.api_url):
            _warned_plain_http.add(self.api_url)
            warn(
                f"sending your credential over plain http to {self.api_url}; "
                "use https for anything but a loopback address"
            )

    def require_credential(self, what: str) -> Credential:
        if self.credential is None:
            raise KvcdnError(f"{what}: not logged in; {LOGIN_HINT}")
        return self.credential

    def request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        auth: bool = True,
        json: Any = None,
        params: dict | None = None,
        headers: dict | None = None,
        ok=(200, 201, 204),
        attempts: int = ATTEMPTS,
        timeout: float | None = None,
        idempotent: bool | None = None,
    ):
        """Send with retries on transient failures; raise a one-line error on a final failure.

        A request that is not idempotent (a POST unless the caller says otherwise) is sent again
        only when it surely was not processed: the connection was never made, or a 429.
        """
        import httpx

        url = self.url(path)
        sent = dict(self.headers(auth))
        sent.update(headers or {})
        if auth and self.credential is not None:
            self._warn_plain_http()
        if idempotent is None:
            idempotent = method.upper() in IDEMPOTENT_METHODS
        for attempt in range(attempts):
            try:
                kwargs = {"json": json, "params": params, "headers": sent}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                response = self.http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                unsent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                if attempt + 1 < attempts and (idempotent or unsent):
                    time.sleep(backoff_delay(attempt))
                    continue
                error = ServiceTimeout if isinstance(exc, httpx.TimeoutException) else KvcdnError
                raise error(f"{what}: cannot reach {self.api_url} ({type(exc).__name__}: {exc})") from None
            retry = TRANSIENT_STATUSES if idempotent else UNPROCESSED_STATUSES
            if (response.status_code in retry or _not_done(response)) and attempt + 1 < attempts:
                time.sleep(backoff_delay(attempt, response.headers.get("Retry-After")))
                continue
            if response.status_code in ok:
                return response
            raise_for_response(response, what)
            raise KvcdnError(f"{what}: unexpected status {response.status_code}")
        raise AssertionError("unreachable")

    def read(self, model: type[A], method: str, path: str, *, what: str, **kwargs) -> A:
        """Send, then read the answer as ``model`` (a :mod:`kvcdn_wire.responses` body), once."""
        return parse_answer(model, self.request(method, path, what=what, **kwargs), what)


def parse_answer(model: type[A], response, what: str) -> A:
    """The response's JSON body as ``model``; a body of another shape is one error line (exit 2)."""
    from pydantic import ValidationError

    from kvcdn_wire.responses import parse

    try:
        data = response.json()
    except ValueError:
        raise not_kvcdn(response, what) from None
    try:
        return parse(model, data)
    except ValidationError as exc:
        first = exc.errors()[0]  # a ValidationError has at least one
        where = ".".join(str(p) for p in first["loc"]) or "the body"
        raise KvcdnError(f"{what}: unexpected data in the server's answer ({where}: {first['msg']})") from None


def error_code(response) -> str | None:
    """The ``error`` code of a refusal, or None when the body is no kvcdn error."""
    from pydantic import ValidationError

    from kvcdn_wire.responses import ErrorBody, parse

    try:
        return parse(ErrorBody, response.json()).error
    except (ValueError, ValidationError):
        return None


_warned_plain_http: set[str] = set()


def _not_done(response) -> bool:
    """A 503 whose code says the server changed nothing (its database was away): safe to resend."""
    return response.status_code == 503 and error_code(response) in NOT_DONE_UNAVAILABLE


def insecure_remote(url: str) -> bool:
    """True for an ``http://`` URL whose host is not a loopback address."""
    import ipaddress
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http":
        return False
    host = (parts.hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def _user_agent() -> str:
    import kvcdn_core
    from kvcdn_hosted import __version__

    return f"kvcdn/{kvcdn_core.__version__} kvcdn-hosted/{__version__}"
