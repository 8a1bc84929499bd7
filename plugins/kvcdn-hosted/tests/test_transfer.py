"""Streaming transfers: sha256 and .kv checked, retries on transient errors, nothing half-written."""

import hashlib
import json
import os

import httpx
import pytest

from kvcdn_core.errors import CheckFailed, KvcdnError
from kvcdn_hosted import client, transfer


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(client, "BACKOFF_BASE_S", 0.01)


def serve_bytes(data, status=200):
    return lambda h: (status, {"Content-Type": "application/octet-stream"}, data)


def cut_half_way(data):
    """Promise the whole body, send half of it, hang up."""

    def route(h):
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data[: len(data) // 2])
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(2)

    return route


def test_download_checks_and_renames(receiver, kv_file, tmp_path):
    data = kv_file.read_bytes()
    receiver.routes[("GET", "/blob")] = serve_bytes(data)
    target = tmp_path / "out" / "got.kv"
    with httpx.Client() as http:
        transfer.download_to(
            http, receiver.url + "/blob", target, sha256=hashlib.sha256(data).hexdigest(), size=len(data), quiet=True
        )
    assert target.read_bytes() == data
    assert os.listdir(target.parent) == ["got.kv"]


@pytest.mark.parametrize("case", ["cut", "sha", "size", "not-kv", "403"])
def test_failed_download_leaves_nothing(receiver, kv_file, tmp_path, case):
    data = kv_file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    route = {
        "cut": cut_half_way(data),
        "sha": serve_bytes(data),
        "size": serve_bytes(data),
        "not-kv": serve_bytes(b"x" * 100),
        "403": serve_bytes(b'{"error":"url_expired"}', 403),
    }[case]
    receiver.routes[("GET", "/blob")] = route
    expected_sha = (
        "0" * 64 if case == "sha" else (hashlib.sha256(b"x" * 100).hexdigest() if case == "not-kv" else digest)
    )
    size = len(data) + 1 if case == "size" else None
    out = tmp_path / "out"
    with httpx.Client() as http, pytest.raises(KvcdnError) as err:
        transfer.download_to(
            http, receiver.url + "/blob", out / "got.kv", sha256=expected_sha, size=size, quiet=True, attempts=2
        )
    assert os.listdir(out) == [], os.listdir(out)
    message = str(err.value)
    assert "\n" not in message
    assert {"cut": "after 2 attempts", "sha": "sha256", "size": "expected", "not-kv": "not a valid .kv", "403": "403"}[
        case
    ] in message
    if case == "cut":
        assert receiver.count("GET", "/blob") == 2
    # bytes that arrived but are not what was promised are a failed check (exit 1)
    assert isinstance(err.value, CheckFailed) == (case in ("sha", "size", "not-kv")), case


def test_download_retries_transient_errors(receiver, kv_file, tmp_path):
    data = kv_file.read_bytes()
    answers = [serve_bytes(b"busy", 503), cut_half_way(data), serve_bytes(data)]
    receiver.routes[("GET", "/blob")] = lambda h: answers.pop(0)(h)
    with httpx.Client() as http:
        transfer.download_to(
            http,
            receiver.url + "/blob",
            tmp_path / "a.kv",
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
            quiet=True,
        )
    assert (tmp_path / "a.kv").read_bytes() == data
    assert receiver.count("GET", "/blob") == 3


def test_upload_streams_exact_bytes_and_retries(receiver, kv_file):
    data = kv_file.read_bytes()
    got = []

    def put(h):
        got.append(h.body)
        return (503, {"Retry-After": "0"}, b"") if len(got) == 1 else (200, {"ETag": '"abc"'}, b"{}")

    receiver.routes[("PUT", "/up")] = put
    with httpx.Client() as http:
        response = transfer.put_bytes(
            http, receiver.url + "/up", kv_file, quiet=True, headers={"Content-Type": "application/octet-stream"}
        )
    assert response.headers["ETag"] == '"abc"'
    assert got == [data, data]
    _m, _p, headers, _b = receiver.requests[-1]
    assert headers["Content-Length"] == str(len(data))
    assert "Authorization" not in headers


def test_upload_range_for_multipart(receiver, kv_file):
    data = kv_file.read_bytes()
    receiver.routes[("PUT", "/part")] = lambda h: (200, {"ETag": '"p"'}, b"")
    with httpx.Client() as http:
        transfer.put_bytes(http, receiver.url + "/part", kv_file, start=10, length=100, quiet=True)
    assert receiver.requests[-1][3] == data[10:110]


def test_upload_client_error_is_one_line(receiver, kv_file):
    receiver.routes[("PUT", "/up")] = lambda h: (403, {}, {"error": "url_expired", "message": "the URL expired"})
    with httpx.Client() as http, pytest.raises(KvcdnError, match="403: the URL expired"):
        transfer.put_bytes(http, receiver.url + "/up", kv_file, quiet=True)
    assert receiver.count("PUT", "/up") == 1


def test_server_message_reads_a_kvcdn_refusal_and_keeps_any_other_body_one_line():
    """A kvcdn refusal is read as the wire's ErrorBody: its message. Any other body, JSON of another
    shape included (a storage's or a proxy's), is shown as it is, one line, not mined for a field."""

    def answer(status, **kwargs):
        return httpx.Response(status, request=httpx.Request("GET", "http://s/x"), **kwargs)

    refusal = {"error": "quota_exceeded", "message": "over quota:\n  10 GiB used"}
    assert client.server_message(answer(429, json=refusal)) == "over quota: 10 GiB used"
    assert json.loads(client.server_message(answer(404, json={"detail": "gone"}))) == {"detail": "gone"}
    odd = {"error": "x", "message": ["a"]}
    assert json.loads(client.server_message(answer(400, json=odd))) == odd
    xml = "<Error>\n  <Code>AccessDenied</Code>\n" + "  <Pad>" + "p" * 300 + "</Pad>\n</Error>"
    shown = client.server_message(answer(403, text=xml))
    assert shown.startswith("<Error> <Code>AccessDenied</Code>") and len(shown) == 200 and "\n" not in shown
    assert client.server_message(answer(502)) == "Bad Gateway"
