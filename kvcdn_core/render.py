"""Command output: JSON for tools, aligned text for people; every command renders through here.

Library code returns data and never prints; a command passes what it got to :func:`render`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from typing import Any

import click


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


def warn(message: str) -> None:
    """A one-line warning on stderr."""
    click.echo(f"warning: {message}", err=True)
