"""Command output: JSON for tools, aligned text for people; every command renders through here.

Library code returns data and never prints; a command passes what it got to :func:`render`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

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


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Rows (the first is the header) in columns padded to their widest cell."""
    if not rows:
        return
    widths = [max(len(str(row[c])) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def warn(message: str) -> None:
    """A one-line warning on stderr."""
    click.echo(f"warning: {message}", err=True)
