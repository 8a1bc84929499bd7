"""Generate docs/cli.md from the click definitions, so the CLI reference cannot drift.

    python -m kvcdn_core.clidoc > docs/cli.md

A test regenerates it and fails when the committed file differs.
"""

from __future__ import annotations

import inspect
import sys

import click


def _option_row(param: click.Parameter, ctx: click.Context) -> str:
    if isinstance(param, click.Argument):
        return f"| `{param.human_readable_name}` | argument{' (required)' if param.required else ''} | |"
    names = ", ".join(f"`{n}`" for n in param.opts + param.secondary_opts)
    kind = "flag" if getattr(param, "is_flag", False) else param.type.name
    if isinstance(param.type, click.Choice):
        kind = "|".join(param.type.choices)
    default = param.get_default(ctx, call=False)
    shown = "" if default in (None, False, ()) or callable(default) else f" [default: {default!r}]"
    help_text = (getattr(param, "help", None) or "").replace("|", "\\|").replace("\n", " ")
    return f"| {names} | {kind.replace('|', ' / ')} | {help_text}{shown} |"


def _command_section(name: str, cmd: click.Command, level: int = 2) -> list[str]:
    ctx = click.Context(cmd, info_name=name)
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    lines = [f"{'#' * level} `kvcdn {name}`", "", "```", f"kvcdn {name} {usage}".strip(), "```", ""]
    if cmd.help:
        lines += [inspect.cleandoc(cmd.help).replace("\b\n", ""), ""]
    params = [p for p in cmd.params if p.name != "help"]
    if params:
        lines += ["| option | type | description |", "| --- | --- | --- |"]
        lines += [_option_row(p, ctx) for p in params]
        lines.append("")
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
        "It lists the commands of core and of every plugin installed when it was generated.",
        "",
    ]
    for name in sorted(root.commands):
        lines += _command_section(name, root.commands[name])
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render())
