"""The hooks: the hosted commands and the hosted storage backend.

Kept import-light so that ``kvcdn --help`` stays fast and torch-free.
"""

from __future__ import annotations

from kvcdn_core import hookimpl


@hookimpl
def kvcdn_register_commands(cli):
    from kvcdn_hosted.commands import COMMANDS

    for command in COMMANDS:
        cli.add_command(command)


@hookimpl
def kvcdn_register_storage_backends():
    from kvcdn_hosted.storage import HostedStorage

    return [HostedStorage]
