"""Command output: JSON for tools, aligned text for people; every command renders through here.

Library code returns data and never prints; a command passes what it got to :func:`render`, and
what the library reports while it works (warnings, notes, progress) is shown by :func:`reporting`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TextIO

import click

from kvcdn_core import progress
from kvcdn_core.notices import KvcdnNote, KvcdnWarning


def emit_json(data: Any) -> None:
    """``data`` as indented JSON on stdout (``--format json``)."""
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def render(data: Any, fmt: str, table: Callable[[Any], None]) -> None:
    """Print a command's result: JSON when ``fmt`` is ``json``, else ``table(data)`` for people."""
    if fmt == "json":
        emit_json(data)
    else:
        table(data)


def table_lines(rows: Sequence[Sequence[Any]], right: Collection[int] = ()) -> list[str]:
    """Rows (the first is the header) as lines of columns padded to their widest cell; columns whose
    index is in ``right`` are right-aligned (numbers); None prints as an empty cell."""
    if not rows:
        return []
    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in cells
    ]


def print_table(rows: Sequence[Sequence[Any]], right: Collection[int] = ()) -> None:
    """Print :func:`table_lines`."""
    for line in table_lines(rows, right):
        click.echo(line)


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Show on stderr what the library reports while the block runs: each :class:`KvcdnWarning` as
    ``warning: <message>``, each :class:`KvcdnNote` as it is (every one, not once per place), and
    progress as a bar when stderr is a terminal. Other warnings are shown as Python shows them.

    Re-entrant: ``kvcdn``'s entry point and its command group both wrap their work in it, and an
    inner block adds nothing (one bar, each warning once)."""
    global _reporting
    if _reporting:
        yield
        return
    _reporting = True
    try:
        with _reporting_block():
            yield
    finally:
        _reporting = False


_reporting = False


@contextlib.contextmanager
def _reporting_block() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("always", KvcdnWarning)
        warnings.simplefilter("always", KvcdnNote)
        python_shows = warnings.showwarning

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if issubclass(category, KvcdnWarning):
                click.echo(f"warning: {message}", err=True)
            elif issubclass(category, KvcdnNote):
                click.echo(str(message), err=True)
            else:
                python_shows(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        with progress.listening(progress_bar):
            yield


def progress_bar(event: progress.ProgressEvent) -> None:
    """One progress event as a bar redrawn in place on stderr, only on a terminal."""
    if not sys.stderr.isatty():
        return
    if event.finished:
        sys.stderr.write("\n")
        sys.stderr.flush()
        return
    pct = 100 * event.done / event.total
    rate = event.done / max(event.elapsed, 1e-9)
    width = 30
    filled = int(width * event.done / event.total)
    bar = "#" * filled + "-" * (width - filled)
    if event.unit == "bytes":
        human = progress.human_bytes
        counts = f"{human(event.done)}/{human(event.total)} {pct:3.0f}% {human(rate)}/s"
    else:
        counts = f"{event.done}/{event.total} {event.unit} {pct:3.0f}% {rate:,.0f} {event.unit}/s"
    sys.stderr.write(f"\r{event.label} [{bar}] {counts}   ")
    sys.stderr.flush()
