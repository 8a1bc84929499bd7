"""Core's commands, registered through the same hook as any plugin's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcdn_core import hookimpl

if TYPE_CHECKING:  # pragma: no cover - typing only
    import click


@hookimpl
def kvcdn_register_commands(cli: click.Group) -> None:
    from kvcdn_core.cli.commands import (
        benchmark,
        continue_cmd,
        diag,
        generate,
        inspect,
        plot,
        plugins_cmd,
        quant,
        search,
        store,
        validate,
        verify,
    )

    for module in (
        generate,
        verify,
        diag,
        inspect,
        continue_cmd,
        plugins_cmd,
        benchmark,
        plot,
        search,
        quant,
        validate,
        store,
    ):
        cli.add_command(module.command)
