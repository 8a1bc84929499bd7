"""Generate docs/cli.md from the click definitions, so the CLI reference cannot drift.

    python -m kvcdn_core.clidoc > docs/cli.md

A test regenerates it and fails when the committed file differs.
"""

from __future__ import annotations

import sys

import click

#: The width the reference is rendered at (and a test compares `--help` at).
WIDTH = 100


def help_text(name: str, cmd: click.Command) -> str:
    """What `kvcdn <name> --help` prints at :data:`WIDTH` columns."""
    ctx = click.Context(cmd, info_name=f"kvcdn {name}", terminal_width=WIDTH, max_content_width=WIDTH)
    return cmd.get_help(ctx)


def _command_section(name: str, cmd: click.Command, level: int = 2) -> list[str]:
    lines = [f"{'#' * level} `kvcdn {name}`", "", "```text", help_text(name, cmd), "```", ""]
    if isinstance(cmd, click.Group):
        for sub_name in sorted(cmd.commands):
            lines += _command_section(f"{name} {sub_name}", cmd.commands[sub_name], level + 1)
    return lines


def render() -> str:
    from kvcdn_core.cli import make_cli

    root = make_cli()
    lines = [
        "# kvcdn command reference",
        "",
        "Generated from the click definitions by `python -m kvcdn_core.clidoc`; do not edit by hand.",
        "Each section is exactly what `kvcdn <command> --help` prints at 100 columns, for the commands",
        "of core and of every plugin installed when it was generated.",
        "",
    ]
    for name in sorted(root.commands):
        lines += _command_section(name, root.commands[name])
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render())
