"""Telemetry: one minimal event per hosted command, off with KVCDN_TELEMETRY=0, never slow."""

import json
import threading
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


def test_a_receiver_that_never_answers_holds_neither_the_command_nor_the_exit(receiver, config_home):
    """send returns while the receiver is still stalled, and its thread ends by its own timeouts.

    The limits here (10 s) are far above the 150 ms the code waits: only a send that waits for the
    receiver's answer (30 s away) reaches them, however loaded the machine.
    """
    answer = threading.Event()

    def stalled(handler):
        answer.wait(30)
        return 204, {}, b""

    receiver.routes[("POST", "/api/v1/telemetry")] = stalled
    returned = threading.Event()
    sent = []

    def command():
        sent.append(telemetry.send(Settings(api_url=receiver.url), "list", 0.5, True))
        returned.set()

    threading.Thread(target=command, daemon=True).start()
    try:
        assert returned.wait(10), "send waited for a receiver that does not answer"
        thread = sent[0]
        assert thread is not None and not thread.daemon  # joined at exit: never cut off inside the client
        thread.join(10)
        assert not thread.is_alive(), "the telemetry thread outlived its own timeouts"
        assert wait_for(lambda: receiver.count("POST", "/api/v1/telemetry") == 1, timeout=10)  # it did go out
    finally:
        answer.set()


def test_dead_receiver_is_silent(config_home, capsys):
    thread = telemetry.send(Settings(api_url="http://127.0.0.1:9"), "list", 0.1, True)
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
    assert capsys.readouterr() == ("", "")
