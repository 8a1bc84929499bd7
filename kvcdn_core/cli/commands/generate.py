"""``kvcdn generate``: prefill a document once and save its KV cache as a `.kv` artifact."""

from __future__ import annotations

import time

import click

from kvcdn_core.cli.commands.common import (
    artifact_path,
    check_new_output,
    force_output_option,
    format_option,
    model_options,
    read_text_file,
)
from kvcdn_core.cli.render import emit_json
from kvcdn_core.model.defaults import DEFAULT_CHUNK, DEFAULT_MODEL


@click.command("generate")
@model_options(from_artifact=False)
@click.option("--context-file", required=True, help="UTF-8 text file with the document to cache.")
@click.option(
    "--output",
    "-o",
    default=None,
    help="Artifact path [default: $XDG_DATA_HOME/kvcdn/generate/generate-<ms>-<model>.kv].",
)
@click.option(
    "--chunk-size", type=click.IntRange(1), default=DEFAULT_CHUNK, show_default=True, help="Tokens per prefill step."
)
@force_output_option
@format_option
def command(model, revision, device, dtype, quiet, context_file, output, chunk_size, force, fmt):
    """Prefill the document in --context-file once and save its KV cache as a .kv artifact."""
    from kvcdn_core import runtime

    model = model or DEFAULT_MODEL
    context = read_text_file(context_file)
    path = artifact_path(output, "generate", model)
    check_new_output(path, force)
    session = runtime.load_session(model, revision, device, dtype)
    start = time.perf_counter()
    path, ids = runtime.generate(session, context, path, chunk=chunk_size, progress=not quiet)
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    if fmt == "json":
        emit_json(
            {
                "path": str(path),
                "model": session.model_ref,
                "tokens": len(ids),
                "bytes": size,
                "seconds": round(seconds, 4),
                "dtype": session.dtype,
            }
        )
    else:
        click.echo(f"wrote {path}")
        click.echo(f"  {len(ids)} tokens, {size / 1e6:.2f} MB, {session.dtype}, {seconds:.2f}s prefill+save")
