"""Opt-out usage telemetry: one small event per hosted command, never in the way.

What is sent: the command name, the kvcdn version, the duration and whether it succeeded. Never
prompts, file contents, paths, artifact names or ids, tokens or who you are (no Authorization
header either). Off with the ``telemetry`` setting (``KVCDN_TELEMETRY=0``); never sent when no
``api_url`` is configured.
The event goes out after the command's output is written, from a thread that the command waits
for at most :data:`MAX_WAIT_S`; the request's own timeouts are that long too, and the process ends
once the thread has. Not a daemon thread: one still inside the HTTP client when the interpreter
shut down crashed the process (exit 139, under load in CI) after the command had succeeded.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvcdn_wire import TELEMETRY

if TYPE_CHECKING:
    from kvcdn_hosted.config import Settings

MAX_WAIT_S = 0.150
PATH = TELEMETRY


def enabled(settings: Settings) -> bool:
    return bool(settings.api_url) and settings.telemetry


def event(command: str, duration_s: float, success: bool) -> dict:
    import kvcdn_core

    return {
        "event": "command",
        "command": command,
        "kvcdn_version": kvcdn_core.__version__,
        "duration_ms": int(round(duration_s * 1000)),
        "ok": bool(success),
    }


def _post(url: str, payload: dict, timeout: float) -> None:
    import httpx

    try:
        httpx.post(url, json=payload, timeout=timeout)
    except Exception:  # telemetry must never surface an error
        pass


def send(
    settings: Settings, command: str, duration_s: float, success: bool, max_wait_s: float = MAX_WAIT_S
) -> threading.Thread | None:
    """Send one event if telemetry is on; return after it was sent or ``max_wait_s``, whichever first
    (the thread then ends by its own timeouts of ``max_wait_s`` each)."""
    api_url = settings.api_url
    if api_url is None or not enabled(settings):
        return None
    import httpx  # noqa: F401  (already loaded by every hosted command; import here, not in the thread)

    started = time.monotonic()
    thread = threading.Thread(
        target=_post,
        args=(api_url.rstrip("/") + PATH, event(command, duration_s, success), max_wait_s),
        name="kvcdn-telemetry",
        daemon=False,  # the interpreter waits for it at exit (a daemon inside httpx crashed the exit)
    )
    thread.start()
    thread.join(max(0.0, max_wait_s - (time.monotonic() - started)))
    return thread
