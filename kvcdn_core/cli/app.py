"""The ``kvcdn`` command: a click group whose commands all come from plugins (core's included).

Start-up imports click, pluggy and stevedore only; commands import torch when they run.
"""

from __future__ import annotations

import os
import sys
import traceback

import click

import kvcdn_core
from kvcdn_core.cli.render import reporting
from kvcdn_core.errors import KvcdnError, interruption
from kvcdn_core.plugin_host.manager import debug_enabled
from kvcdn_core.plugin_host.registry import register_commands


class KvcdnGroup(click.Group):
    """Turns kvcdn errors into one stderr line and the documented exit code, never a traceback."""

    def invoke(self, ctx):
        try:
            with reporting():  # what the library reports while the command runs
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KvcdnError as exc:
            _fail(ctx, str(exc), exc.exit_code)
        except KeyboardInterrupt:
            _fail(ctx, "interrupted", 130)
        except OSError as exc:
            where = f" '{exc.filename}'" if getattr(exc, "filename", None) else ""
            _fail(ctx, f"{exc.strerror or exc}{where}", 2)
        except Exception as exc:  # a bug: still one line, the traceback on request
            if interruption(exc) is not None:  # a Ctrl-C that a library wrapped in its own error
                _fail(ctx, "interrupted", 130)
            if debug_enabled():
                traceback.print_exc()
            hint = "" if debug_enabled() else " (set KVCDN_DEBUG=1 for the traceback)"
            detail = " ".join(str(exc).split())  # one line, whatever the message holds
            _fail(ctx, f"unexpected {type(exc).__name__}: {detail}{hint}", 2)


def _fail(ctx, message: str, code: int):
    click.echo(f"error: {message}", err=True)
    ctx.exit(code)


@click.group(cls=KvcdnGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(kvcdn_core.__version__, prog_name="kvcdn")
def cli():
    """kvcdn: reusable, verified KV-cache artifacts for LLM prefill.

    Generate a document's KV cache once into a .kv artifact, verify that continuing from it is
    token-exact against a full prefill, and reuse it. Exit codes: 0 success, 1 a check failed,
    2 usage or input error.
    """


def make_cli() -> click.Group:
    register_commands(cli)
    return cli


def main(argv=None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with reporting():  # plugin discovery's warnings too
            code = make_cli().main(args=argv, prog_name="kvcdn", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:  # a command group called bare: show its help
        click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message(), err=True)
        sys.exit(2)
    except click.UsageError as exc:  # one line, like every other error, with where to look
        where = f"kvcdn {exc.ctx.command_path.partition(' ')[2]}".strip() if exc.ctx else "kvcdn"
        click.echo(f"error: {exc.format_message()} (see '{where} --help')", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
