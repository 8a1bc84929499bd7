"""Model steps in turns: one at a time, the next to the request whose tenant computed least lately.

Requests holding inference slots do not run their forward passes side by side: on a CPU, two
passes each using every core oversubscribe it, and a long request of a flooding tenant slows every
other tenant's request down as much as its own. Instead each forward pass (the question's prefill,
then one per decoded token) takes a turn. The turn belongs to the running request whose tenant has
the least *recent usage* (the seconds its passes took, decaying with a half-life of
:data:`HALF_LIFE` seconds); among requests of one tenant, to the oldest. It belongs to that request
even in the instant between two of its steps, so the others wait for it rather than slip in.

So a long request yields between its decode steps: a tenant that computes little (an interactive
user) runs at once, ahead of a tenant that computes all the time, and waits at most for the one
step in progress; two tenants that both compute all the time alternate, each getting half.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

#: seconds after which a tenant's past usage counts half
HALF_LIFE = 30.0
#: how often a request waiting for its turn checks whether it was cancelled (seconds)
CANCEL_POLL = 0.2


class TurnCancelled(Exception):
    """The request was cancelled while it waited for its turn."""


class Turns:
    def __init__(self, half_life: float = HALF_LIFE, clock: Callable[[], float] = time.monotonic):
        self.half_life, self.clock = half_life, clock
        self._cond = threading.Condition()
        self._busy = False
        self._running: dict[int, str] = {}  # ticket (arrival order) -> tenant, of requests computing
        self._waiting: set[int] = set()  # tickets waiting for a turn now
        self._usage: dict[str, tuple[float, float]] = {}  # tenant -> (seconds, as of when)
        self._tickets = itertools.count()

    def usage(self, tenant: str) -> float:
        """``tenant``'s decayed usage now, in seconds."""
        with self._cond:
            return self._used(tenant, self.clock())

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @contextlib.contextmanager
    def request(self, tenant: str) -> Iterator[int]:
        """One request of ``tenant`` computing: yields the ticket its :meth:`step` calls name."""
        with self._cond:
            ticket = next(self._tickets)
            self._running[ticket] = tenant
        try:
            yield ticket
        finally:
            with self._cond:
                del self._running[ticket]
                self._cond.notify_all()

    @contextlib.contextmanager
    def step(self, ticket: int, cancel: threading.Event | None = None) -> Iterator[None]:
        """Hold the model for one forward pass of request ``ticket``; :class:`TurnCancelled` once
        ``cancel`` is set while it waits."""
        tenant = self._running[ticket]
        with self._cond:
            self._waiting.add(ticket)
            try:
                while self._busy or self._next() != ticket:
                    if cancel is not None and cancel.is_set():
                        raise TurnCancelled()
                    self._cond.wait(CANCEL_POLL)
            finally:
                self._waiting.discard(ticket)
            self._busy = True
        start = self.clock()
        try:
            yield
        finally:
            with self._cond:
                now = self.clock()
                self._usage[tenant] = (self._used(tenant, now) + (now - start), now)
                self._forget(now)
                self._busy = False
                self._cond.notify_all()

    def _used(self, tenant: str, now: float) -> float:
        seconds, when = self._usage.get(tenant, (0.0, now))
        return seconds * 0.5 ** (max(0.0, now - when) / self.half_life)

    def _next(self) -> int:
        now = self.clock()
        return min(self._running, key=lambda ticket: (self._used(self._running[ticket], now), ticket))

    def _forget(self, now: float) -> None:
        """Drop tenants whose usage has decayed below a millisecond: the table stays small."""
        for tenant in [t for t in self._usage if self._used(t, now) < 1e-3]:
            del self._usage[tenant]
