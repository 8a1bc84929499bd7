"""The hook: ``kvcdn vllm-serve``. Import-light: vLLM is imported only by the server process."""

from __future__ import annotations

from kvcdn_core import hookimpl


@hookimpl
def kvcdn_register_commands(cli):
    from kvcdn_vllm.serve import command

    cli.add_command(command)
