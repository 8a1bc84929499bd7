"""A small progress bar on stderr, shown only on a terminal and never with ``--quiet``."""

from __future__ import annotations

import sys
import time


def human_bytes(n: float) -> str:
    """``1065162714`` → ``1015.8 MiB``: a byte count or rate for people."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    def __init__(self, total: int, label: str, unit: str = "tokens", enabled: bool = True):
        self.total, self.label, self.unit = max(total, 1), label, unit
        self.enabled = enabled and sys.stderr.isatty()
        self.done = 0
        self.start = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        pct = 100 * self.done / self.total
        rate = self.done / max(time.monotonic() - self.start, 1e-9)
        width = 30
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        if self.unit == "bytes":
            counts = f"{human_bytes(self.done)}/{human_bytes(self.total)} {pct:3.0f}% {human_bytes(rate)}/s"
        else:
            counts = f"{self.done}/{self.total} {self.unit} {pct:3.0f}% {rate:,.0f} {self.unit}/s"
        sys.stderr.write(f"\r{self.label} [{bar}] {counts}   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
