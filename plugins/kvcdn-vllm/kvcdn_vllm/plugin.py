"""The hook: ``kvcdn vllm-serve``. Import-light: vLLM is imported only by the server process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcdn_core import hookimpl

if TYPE_CHECKING:  # pragma: no cover - typing only
    import click


@hookimpl
def kvcdn_register_commands(cli: click.Group) -> None:
    from kvcdn_vllm.serve import command

    cli.add_command(command)
