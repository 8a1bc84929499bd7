"""Time limits for tests that scale with how fast this machine is right now.

A test must fail only on a wrong result, never because the machine was busy: every wall-clock limit
a test sets (a subprocess's timeout, a wait for a condition, a whole example file) is written as
``budget(seconds)``, the time it needs on an idle core, and grows with :func:`slowdown`, measured by
timing a fixed CPU-bound workload (re-measured at most every :data:`RECALIBRATE_S`, since the load
on a shared machine changes during a run). ``KVCDN_TEST_TIME_SCALE`` multiplies it further (a slow
emulator, a debugger).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import threading
import time

#: seconds the reference workload takes on one idle core of an ordinary development machine
REFERENCE_S = 0.05
#: how often the slowdown is measured again
RECALIBRATE_S = 30.0

_lock = threading.Lock()
_measured: tuple[float, float] | None = None  # (when, slowdown)


def _reference_workload() -> float:
    """Seconds for a fixed mix of interpreter work and hashing, like the tests' own."""
    start = time.perf_counter()
    total = 0
    for i in range(300_000):
        total += i * i % 7
    hashlib.sha256(bytes(4 << 20)).digest()
    return time.perf_counter() - start


def measure_slowdown(runs: int = 5) -> float:
    """How many times slower than :data:`REFERENCE_S` the workload runs now (at least 1)."""
    return max(1.0, statistics.median(_reference_workload() for _ in range(runs)) / REFERENCE_S)


def slowdown() -> float:
    """The current slowdown, times ``KVCDN_TEST_TIME_SCALE``; measured again when stale."""
    global _measured
    with _lock:
        now = time.monotonic()
        if _measured is None or now - _measured[0] > RECALIBRATE_S:
            _measured = (now, measure_slowdown())
        factor = _measured[1]
    return factor * float(os.environ.get("KVCDN_TEST_TIME_SCALE") or 1.0)


def budget(seconds: float) -> float:
    """``seconds`` (enough on an idle core) scaled to this machine's current speed."""
    return seconds * slowdown()


def wait_until(condition, seconds: float, interval: float = 0.02) -> float:
    """Poll ``condition()`` until it holds; seconds it took. Fails after ``budget(seconds)``."""
    start = time.monotonic()
    limit = budget(seconds)
    while not condition():
        elapsed = time.monotonic() - start
        assert elapsed < limit, f"condition not reached in {elapsed:.1f}s (budget {seconds}s x slowdown)"
        time.sleep(interval)
    return time.monotonic() - start
