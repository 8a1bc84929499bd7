"""Generate docs/cli.md from the click definitions, so the CLI reference cannot drift.

    python -m kvcdn_core.cli.reference > docs/cli.md

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


#: The rules every command follows; a new command follows them too.
CONVENTIONS = """## Conventions

- `--format table|json` on every command that reports: table for people, json for tools (some add
  a form, such as `ids`). Errors are one line on stderr whatever the format.
- Exit codes: 0 success, 1 a check ran and failed, 2 usage or input error, 130 interrupted.
- `--output` / `-o` names every file a command writes. An existing file is replaced only with
  `--force`; `.kv` is appended to artifact outputs (never to inputs); every output is checked before
  any model work or download starts.
- `-q` is `--quiet` (no progress on stderr) and nothing else.
- The artifact a model command reads is `--kv-path` (verify, diag, continue, quant); file commands
  that take a path and no model (inspect, upload, store put) take it as an argument. The text to
  look up or continue is `--prompt` / `--prompt-file` (search, continue).
- Old spellings keep working for one release with a `warning: ... is deprecated` line: `plot --out`
  (now `--output`), `infer -q` (now `--question`), `quant --input` (now `--kv-path`), `search
  --query` / `--query-file` (now `--prompt` / `--prompt-file`).
- `--n` is the number of tokens a command decodes. Its default is 32 where a person reads the
  tokens or compares them (verify, diag, infer); `continue` generates 64; `quant --verify` checks 8
  and `validate` 16 per shape, because they repeat the comparison for every scheme or architecture.
"""


def render() -> str:
    from kvcdn_core.cli.app import make_cli

    root = make_cli()
    lines = [
        "# kvcdn command reference",
        "",
        "Generated from the click definitions by `python -m kvcdn_core.cli.reference`; do not edit by hand.",
        "Each section is exactly what `kvcdn <command> --help` prints at 100 columns, for the commands",
        "of core and of every plugin installed when it was generated.",
        "",
        CONVENTIONS,
    ]
    for name in sorted(root.commands):
        lines += _command_section(root, (name,), root.commands[name])
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render())
