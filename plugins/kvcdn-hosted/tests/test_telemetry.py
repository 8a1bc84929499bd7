"""Telemetry: one minimal event per hosted command, off with KVCDN_TELEMETRY=0, never slow."""

import json
import time

from click.testing import CliRunner

from kvcdn_core.cli.app import make_cli
from kvcdn_hosted import telemetry
from kvcdn_hosted.config import Settings

ALLOWED = {"event", "command", "kvcdn_version", "duration_ms", "ok"}


def wait_for(predicate, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_one_event_with_nothing_identifying(receiver, config_home, monkeypatch, tmp_path):
    receiver.routes[("POST", "/api/v1/telemetry")] = lambda h: (204, {}, b"")
    monkeypatch.setenv("KVCDN_API_URL", receiver.url)
    result = CliRunner().invoke(make_cli(), ["api-key", "set", "kv_" + "ab" * 32])
    assert result.exit_code == 0
    assert wait_for(lambda: receiver.count("POST", "/api/v1/telemetry") == 1)
    time.sleep(0.2)
    assert receiver.count("POST", "/api/v1/telemetry") == 1
    _m, _p, headers, body = receiver.requests[-1]
    event = json.loads(body)
    assert set(event) == ALLOWED
    assert event["command"] == "api-key set" and event["ok"] is True and event["event"] == "command"
    assert "authorization" not in {k.lower() for k in headers}
    assert "ab" * 32 not in body.decode() and str(tmp_path) not in body.decode()


def test_failed_command_reports_ok_false(receiver, config_home, monkeypatch):
    receiver.routes[("POST", "/api/v1/telemetry")] = lambda h: (204, {}, b"")
    monkeypatch.setenv("KVCDN_API_URL", receiver.url)
    result = CliRunner().invoke(make_cli(), ["api-key", "set", "kv_12"])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    assert wait_for(lambda: receiver.count("POST", "/api/v1/telemetry") == 1)
    assert json.loads(receiver.requests[-1][3])["ok"] is False


def test_opt_out_and_no_endpoint_send_nothing(receiver, config_home, monkeypatch):
    receiver.routes[("POST", "/api/v1/telemetry")] = lambda h: (204, {}, b"")
    monkeypatch.setenv("KVCDN_API_URL", receiver.url)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    assert CliRunner().invoke(make_cli(), ["api-key", "clear"]).exit_code == 0
    monkeypatch.delenv("KVCDN_TELEMETRY")
    monkeypatch.delenv("KVCDN_API_URL")
    assert CliRunner().invoke(make_cli(), ["api-key", "clear"]).exit_code == 0
    time.sleep(0.3)
    assert receiver.requests == []


def test_slow_receiver_costs_at_most_150_ms(receiver, config_home):
    def slow(handler):
        time.sleep(1.0)
        return 204, {}, b""

    receiver.routes[("POST", "/api/v1/telemetry")] = slow
    started = time.monotonic()
    thread = telemetry.send(Settings(api_url=receiver.url), "list", 0.5, True)
    waited = time.monotonic() - started
    assert thread is not None and not thread.daemon  # joined at exit: never cut off inside the client
    assert waited < 0.150 + 0.1, waited  # 150 ms budget + scheduling slack on a busy machine
    assert wait_for(lambda: receiver.count("POST", "/api/v1/telemetry") == 1)  # it did go out


def test_dead_receiver_is_silent(config_home):
    started = time.monotonic()
    telemetry.send(Settings(api_url="http://127.0.0.1:9"), "list", 0.1, True)
    assert time.monotonic() - started < 0.150 + 0.1  # 150 ms budget + scheduling slack
