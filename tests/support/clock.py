"""A clock a test moves on itself, for server behaviour that depends on time (expiry, leases): the
app in-process takes it (``create_app(config, clock=...)``), so no test sleeps against a timeout."""

from __future__ import annotations

import time


class ManualClock:
    """Seconds since the epoch, starting now and moving only when :meth:`advance` is called."""

    def __init__(self, start: float | None = None):
        self.now = time.time() if start is None else float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
