"""Generate docs/cli.md from the click definitions, so the CLI reference cannot drift.

    python -m kvcdn_core.clidoc > docs/cli.md

A test regenerates it and fails when the committed file differs.
"""

from __future__ import annotations

import sys

import click

#: The width the reference is rendered at (and a test compares `--help` at).
WIDTH = 100


def help_text(root: click.Group, path: tuple[str, ...]) -> str:
    """What `kvcdn <path> --help` prints in a terminal of :data:`WIDTH` columns: the command is run
    as a user runs it, so options the group adds (``-h``) and defaults show as they really do."""
    from click.testing import CliRunner

    result = CliRunner().invoke(root, [*path, "--help"], prog_name="kvcdn", terminal_width=WIDTH)
    if result.exit_code != 0:
        raise RuntimeError(f"kvcdn {' '.join(path)} --help failed: {result.output}")
    return result.stdout


def _command_section(root: click.Group, path: tuple[str, ...], cmd: click.Command) -> list[str]:
    lines = [f"{'#' * (len(path) + 1)} `kvcdn {' '.join(path)}`", "", "```text", help_text(root, path) + "```", ""]
    if isinstance(cmd, click.Group):
        for sub_name in sorted(cmd.commands):
            lines += _command_section(root, (*path, sub_name), cmd.commands[sub_name])
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
        lines += _command_section(root, (name,), root.commands[name])
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render())
