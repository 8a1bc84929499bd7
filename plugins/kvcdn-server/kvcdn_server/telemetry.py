"""Telemetry intake: events (schema in ``kvcdn_wire.telemetry``) forwarded in the background or
logged as JSON lines, rate-limited per client address."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

import sqlalchemy as sa

from kvcdn_server.db import telemetry_limits

#: events accepted per second from one client address, with bursts up to RATE_BURST; the rest get 429
RATE_PER_S = 20.0
RATE_BURST = 100
log = logging.getLogger("kvcdn.telemetry")
#: where events go without a collector: one JSON line each (``kvcdn serve`` writes them to stderr)
events = logging.getLogger("kvcdn.telemetry.events")


class RateLimit:
    """A token bucket per client address, kept in the database so that every replica shares it:
    ``allow(client)`` is true for at most ``burst`` calls at once, ``rate`` a second after."""

    def __init__(self, db_engine, rate: float | None = None, burst: int | None = None, clock=time.time):
        self.db = db_engine
        self.rate = RATE_PER_S if rate is None else rate
        self.burst = RATE_BURST if burst is None else burst
        self.clock = clock

    def allow(self, client: str) -> bool:
        client = client[:64]
        for _attempt in range(2):
            try:
                with self.db.begin() as c:
                    now = self.clock()
                    row = c.execute(
                        sa.select(telemetry_limits.c.tokens, telemetry_limits.c.updated_at)
                        .where(telemetry_limits.c.client == client)
                        .with_for_update()
                    ).first()
                    if row is None:
                        c.execute(
                            telemetry_limits.insert().values(client=client, tokens=self.burst - 1.0, updated_at=now)
                        )
                        return True
                    tokens = min(self.burst, row.tokens + max(now - row.updated_at, 0) * self.rate)
                    allowed = tokens >= 1
                    c.execute(
                        telemetry_limits.update()
                        .where(telemetry_limits.c.client == client)
                        .values(tokens=tokens - 1 if allowed else tokens, updated_at=now)
                    )
                    return allowed
            except sa.exc.IntegrityError:
                continue  # another request created this client's row first: read it
        return False

    def forget_idle(self) -> int:
        """Drop buckets that have been full for a while (bounded table)."""
        idle = self.burst / self.rate + 60
        with self.db.begin() as c:
            return c.execute(
                telemetry_limits.delete().where(telemetry_limits.c.updated_at < self.clock() - idle)
            ).rowcount


class TelemetrySink:
    """One background thread forwards events; a full queue drops events rather than slow requests.

    Anyone may post events, so a rate limit per client address keeps them from flooding the log or
    the collector.
    """

    def __init__(self, url: str | None, secret: str | None, limit: RateLimit):
        self.url = url
        self.secret = secret
        self.queue: queue.Queue = queue.Queue(maxsize=1000)
        self._thread: threading.Thread | None = None
        self.limit = limit

    def submit(self, event: dict, client: str) -> bool:
        """Take an event from ``client`` (its address); false when over its rate limit (dropped)."""
        if not self.limit.allow(client):
            return False
        if not self.url:
            events.info(json.dumps({"telemetry": event}, sort_keys=True))
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

        assert self.url is not None  # the thread starts only when there is somewhere to send

        headers = {"Authorization": f"Bearer {self.secret}"} if self.secret else {}
        with httpx.Client(timeout=5.0) as client:
            while True:
                event = self.queue.get()
                try:
                    client.post(self.url, json=event, headers=headers)
                except httpx.HTTPError as exc:
                    log.warning("telemetry forward failed: %s", type(exc).__name__)
