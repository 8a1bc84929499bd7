"""Progress of long work (prefill, hashing, transfers) as events; library code never draws it.

Library code counts with :class:`Progress`; each update is a :class:`ProgressEvent` handed to the
listeners registered with :func:`listening`. A command registers the terminal bar of
:func:`kvcdn_core.cli.render.reporting` (shown only on a terminal and never with ``--quiet``); with no
listener, progress costs a counter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator


def human_bytes(n: float) -> str:
    """``1065162714`` → ``1015.8 MiB``: a byte count or rate for people."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclasses.dataclass(frozen=True)
class ProgressEvent:
    """How far one piece of work is: ``done`` of ``total`` ``unit`` after ``elapsed`` seconds;
    ``finished`` once, when it ends."""

    label: str
    unit: str
    done: int
    total: int
    elapsed: float
    finished: bool = False


Listener = Callable[[ProgressEvent], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Hand every progress event to ``listener`` while the block runs (from any thread)."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


class Progress:
    """Counts ``total`` units of work called ``label``; ``enabled=False`` (``--quiet``) reports nothing."""

    def __init__(self, total: int, label: str, unit: str = "tokens", enabled: bool = True):
        self.total, self.label, self.unit = max(total, 1), label, unit
        self.enabled = enabled
        self.done = 0
        self.start = time.monotonic()

    def _report(self, finished: bool) -> None:
        if not self.enabled or not _listeners:
            return
        event = ProgressEvent(
            self.label, self.unit, self.done, self.total, time.monotonic() - self.start, finished=finished
        )
        for listener in list(_listeners):
            listener(event)

    def update(self, n: int) -> None:
        self.done += n
        self._report(False)

    def close(self) -> None:
        self._report(True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
