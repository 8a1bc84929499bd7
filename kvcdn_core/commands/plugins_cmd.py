"""``kvcdn plugins``: every discovered plugin, its hooks and whether it loaded."""

from __future__ import annotations

import click

from kvcdn_core.commands.common import emit_json, format_option


@click.command("plugins")
@format_option
def command(fmt):
    """List discovered plugins: distribution, version, groups, hooks, status and error."""
    from kvcdn_core.plugins import get_host

    infos = sorted(get_host().infos.values(), key=lambda i: (i.status != "loaded", i.name))
    if fmt == "json":
        emit_json([i.as_dict() for i in infos])
        return
    rows = [("NAME", "DISTRIBUTION", "VERSION", "GROUPS", "HOOKS", "STATUS")]
    for i in infos:
        hooks = ",".join(h.removeprefix("kvcdn_register_") for h in i.hooks) or "-"
        rows.append((i.name, i.distribution or "?", i.version or "?", ",".join(i.groups), hooks, i.status))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for i in infos:
        if i.error:
            click.echo(f"{i.name}: {i.error}")
