"""``kvcdn plugins``: every discovered plugin, what it provides and whether it loaded."""

from __future__ import annotations

import click

from kvcdn_core.cli.commands.common import format_option
from kvcdn_core.cli.render import print_table, render

#: The kinds of names a plugin claims, in the order ``kvcdn plugins`` lists them.
KINDS = ("architectures", "schemes", "uri_schemes", "commands")


@click.command("plugins")
@format_option
def command(fmt):
    """List discovered plugins: distribution, version, description, groups, hooks, status and error,
    and what each provides (architectures, quantization schemes, URI schemes, commands).

    When two plugins claim the same name, core's built-ins win, then plugins by name; the claims
    that lost are listed under "overridden"."""
    from kvcdn_core.plugin_host import registry

    host = registry.host()
    host.claims()  # commands were claimed when the CLI started
    infos = sorted(host.infos.values(), key=lambda i: (i.status != "loaded", i.name))
    render([i.as_dict() for i in infos], fmt, _table)


def _table(rows: list[dict]) -> None:
    table = [("NAME", "DISTRIBUTION", "VERSION", "GROUPS", "HOOKS", "STATUS")]
    for i in rows:
        hooks = ",".join(h.removeprefix("kvcdn_register_") for h in i["hooks"]) or "-"
        table.append(
            (i["name"], i["distribution"] or "?", i["version"] or "?", ",".join(i["groups"]), hooks, i["status"])
        )
    print_table(table)
    for i in rows:
        if i["error"]:
            click.echo(f"{i['name']}: {i['error']}")
    click.echo("")
    for i in rows:
        if i["description"]:
            click.echo(f"{i['name']}: {i['description']}")
    for i in rows:
        for kind in KINDS:
            if i["provides"].get(kind):
                click.echo(f"{i['name']}: {kind.replace('_', ' ')}: {', '.join(i['provides'][kind])}")
    for i in rows:
        for line in i["overridden"]:
            click.echo(f"{i['name']}: overridden: {line}")
