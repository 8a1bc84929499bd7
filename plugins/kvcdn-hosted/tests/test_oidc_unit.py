"""OIDC protocol details the real issuer cannot be made to show on demand: RFC 8628 polling
(interval, slow_down, expires_in) and the PKCE loopback's state and timeout checks. The full flows
against the real issuer are in tests/hosted/test_client_login.py."""

import base64
import hashlib
import threading
import time
import urllib.parse

import httpx
import pytest

from kvcdn_core.errors import KvcdnError
from kvcdn_hosted import oidc


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def __call__(self):
        return self.now


def device_routes(receiver, answers, expires_in=30, interval=2):
    receiver.routes[("POST", "/device")] = lambda h: (
        200,
        {},
        {
            "device_code": "dc",
            "user_code": "ABCD-EFGH",
            "verification_uri": receiver.url + "/activate",
            "verification_uri_complete": receiver.url + "/activate?user_code=ABCD-EFGH",
            "expires_in": expires_in,
            "interval": interval,
        },
    )

    def token(h):
        answer = answers.pop(0) if answers else "authorization_pending"
        if answer == "ok":
            return 200, {}, {"access_token": "at", "refresh_token": "rt", "expires_in": 300}
        return 400, {}, {"error": answer}

    receiver.routes[("POST", "/token")] = token
    return {
        "issuer": receiver.url,
        "device_authorization_endpoint": receiver.url + "/device",
        "token_endpoint": receiver.url + "/token",
    }


def test_device_flow_honours_interval_and_slow_down(receiver):
    meta = device_routes(receiver, ["authorization_pending", "slow_down", "authorization_pending", "ok"])
    clock, said = FakeClock(), []
    with httpx.Client() as http:
        tokens = oidc.device_login(http, meta, "kvcdn-cli", say=said.append, sleep=clock.sleep, clock=clock)
    assert tokens["access_token"] == "at"
    assert clock.sleeps == [2, 2, 7, 7]  # +5 s after slow_down, for every later poll
    text = "\n".join(said)
    assert receiver.url + "/activate" in text and "ABCD-EFGH" in text  # always printed
    polls = [b for m, p, _h, b in receiver.requests if p == "/token"]
    assert all(b"device_code=dc" in b and b"grant_type=urn" in b for b in polls)


def test_device_flow_gives_up_at_expires_in(receiver):
    meta = device_routes(receiver, [], expires_in=10, interval=3)
    clock = FakeClock()
    with httpx.Client() as http, pytest.raises(KvcdnError, match="expired before it was approved"):
        oidc.device_login(http, meta, "kvcdn-cli", say=lambda s: None, sleep=clock.sleep, clock=clock)
    assert receiver.count("POST", "/token") == 3 and clock.now == pytest.approx(10)


@pytest.mark.parametrize(
    "error, message", [("access_denied", "denied"), ("expired_token", "expired"), ("invalid_grant", "invalid_grant")]
)
def test_device_flow_stops_on_final_errors(receiver, error, message):
    meta = device_routes(receiver, [error])
    clock = FakeClock()
    with httpx.Client() as http, pytest.raises(KvcdnError, match=message):
        oidc.device_login(http, meta, "kvcdn-cli", say=lambda s: None, sleep=clock.sleep, clock=clock)


def run_pkce(receiver, browser, timeout_s=10.0):
    """pkce_login with ``browser(auth_url)`` run in a thread as the person's browser."""
    exchanged = {}

    def token(h):
        form = dict(urllib.parse.parse_qsl(h.body.decode()))
        exchanged.update(form)
        return 200, {}, {"access_token": "at", "expires_in": 60}

    receiver.routes[("POST", "/token")] = token
    meta = {
        "issuer": receiver.url,
        "authorization_endpoint": receiver.url + "/authorize",
        "token_endpoint": receiver.url + "/token",
        "code_challenge_methods_supported": ["S256"],
    }

    threads = []

    def say(text):
        for line in text.splitlines():
            if line.startswith(receiver.url + "/authorize"):
                threads.append(threading.Thread(target=browser, args=(line,), daemon=True))
                threads[-1].start()

    try:
        with httpx.Client() as http:
            return oidc.pkce_login(http, meta, "kvcdn-cli", say=say, timeout_s=timeout_s), exchanged
    finally:
        for thread in threads:
            thread.join(5)


def callback(auth_url, **override):
    params = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(auth_url).query))
    query = {"code": "the-code", "state": params["state"], **override}
    return httpx.get(params["redirect_uri"] + "?" + urllib.parse.urlencode(query)), params


def test_pkce_exchanges_code_with_verifier(receiver):
    seen = {}

    def browser(url):
        response, params = callback(url)
        seen.update(params, status=response.status_code)

    tokens, exchanged = run_pkce(receiver, browser)
    assert tokens["access_token"] == "at" and seen["status"] == 200
    assert seen["code_challenge_method"] == "S256" and seen["redirect_uri"].startswith("http://127.0.0.1:")
    challenge = base64.urlsafe_b64encode(hashlib.sha256(exchanged["code_verifier"].encode()).digest()).rstrip(b"=")
    assert challenge.decode() == seen["code_challenge"]
    assert exchanged["code"] == "the-code" and exchanged["redirect_uri"] == seen["redirect_uri"]


def test_pkce_refuses_a_wrong_state(receiver):
    with pytest.raises(KvcdnError, match="state does not match"):
        run_pkce(receiver, lambda url: callback(url, state="forged"))
    assert receiver.count("POST", "/token") == 0


def test_pkce_times_out(receiver):
    started = time.monotonic()
    with pytest.raises(KvcdnError, match="timed out"):
        run_pkce(receiver, lambda url: None, timeout_s=1.0)
    assert time.monotonic() - started < 3


def test_refresh_keeps_the_old_refresh_token_when_not_rotated(receiver):
    receiver.routes[("POST", "/token")] = lambda h: (200, {}, {"access_token": "new", "expires_in": 100})
    session = {
        "issuer": receiver.url,
        "client_id": "kvcdn-cli",
        "token_endpoint": receiver.url + "/token",
        "access_token": "old",
        "refresh_token": "rt",
        "expires_at": time.time() + 5,
    }
    assert oidc.needs_refresh(session)
    with httpx.Client() as http:
        new = oidc.refresh(http, session)
    assert new["access_token"] == "new" and new["refresh_token"] == "rt" and not oidc.needs_refresh(new)
    receiver.routes[("POST", "/token")] = lambda h: (400, {}, {"error": "invalid_grant"})
    with httpx.Client() as http, pytest.raises(KvcdnError, match="run kvcdn login"):
        oidc.refresh(http, session)
