"""Telemetry intake: schema-checked events, forwarded in the background or logged as JSON lines."""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_BODY = 8 * 1024
#: events accepted per second by one process, with bursts up to RATE_BURST; the rest get 429
RATE_PER_S = 20.0
RATE_BURST = 100
log = logging.getLogger("kvcdn.telemetry")

PropKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
PropValue = Union[bool, int, float, Annotated[str, StringConstraints(max_length=256)]]


class TelemetryEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")]
    kvcdn_version: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    command: Annotated[str, StringConstraints(max_length=64)] | None = None
    ok: bool | None = None
    duration_ms: Annotated[float, Field(ge=0)] | None = None
    os: Annotated[str, StringConstraints(max_length=32)] | None = None
    python: Annotated[str, StringConstraints(max_length=16)] | None = None
    install_id: Annotated[str, StringConstraints(max_length=64)] | None = None
    props: Annotated[dict[PropKey, PropValue], Field(max_length=20)] | None = None


class RateLimit:
    """A token bucket: ``allow()`` is true for at most ``burst`` calls at once, ``rate`` a second after."""

    def __init__(self, rate: float | None = None, burst: int | None = None, clock=time.monotonic):
        self.rate = RATE_PER_S if rate is None else rate
        self.burst = RATE_BURST if burst is None else burst
        self.clock = clock
        self.tokens = float(self.burst)
        self.updated = clock()
        self.lock = threading.Lock()

    def allow(self) -> bool:
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
            if self.tokens < 1:
                return False
            self.tokens -= 1
            return True


class TelemetrySink:
    """One background thread forwards events; a full queue drops events rather than slow requests.

    Anyone may post events, so a per-process rate limit keeps them from flooding the log or the
    collector.
    """

    def __init__(self, url: str | None, secret: str | None, limit: RateLimit | None = None):
        self.url = url
        self.secret = secret
        self.queue: queue.Queue = queue.Queue(maxsize=1000)
        self._thread = None
        self.limit = limit or RateLimit()

    def submit(self, event: dict) -> bool:
        """Take an event; false when over the rate limit (the event is dropped)."""
        if not self.limit.allow():
            return False
        if not self.url:
            sys.stderr.write(json.dumps({"telemetry": event}, sort_keys=True) + "\n")
            return True
        if self._thread is None:
            self._thread = threading.Thread(target=self._forward, name="kvcdn-telemetry", daemon=True)
            self._thread.start()
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            log.warning("telemetry queue full, event dropped")
        return True

    def _forward(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.secret}"} if self.secret else {}
        with httpx.Client(timeout=5.0) as client:
            while True:
                event = self.queue.get()
                try:
                    client.post(self.url, json=event, headers=headers)
                except httpx.HTTPError as exc:
                    log.warning("telemetry forward failed: %s", type(exc).__name__)
