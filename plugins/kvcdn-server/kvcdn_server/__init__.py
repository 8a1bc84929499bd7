"""kvcdn hosted service: ``kvcdn serve`` (FastAPI + uvicorn).

The plugin registers one command; FastAPI, uvicorn and the app are imported when it runs, so
``kvcdn --help`` stays light.
"""

from kvcdn_core import hookimpl

__version__ = "0.1.0"


@hookimpl
def kvcdn_register_commands(cli):
    from kvcdn_server.command import serve

    cli.add_command(serve)
