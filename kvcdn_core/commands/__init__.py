"""Core's built-in commands, registered through the same hook as any plugin's."""

from kvcdn_core import hookimpl


@hookimpl
def kvcdn_register_commands(cli):
    from kvcdn_core.commands import benchmark, continue_cmd, diag, generate, inspect, plot, plugins_cmd, quant, search, verify, validate

    for module in (generate, verify, diag, inspect, continue_cmd, plugins_cmd, benchmark, plot, search, quant, validate):
        cli.add_command(module.command)
