"""``kvcdn continue``: the local inference path, continuing from a saved artifact."""

from __future__ import annotations

import click

from kvcdn_core.commands.common import emit_json, force_option, format_option, model_options, open_artifact
from kvcdn_core.paths import ensure_kv_suffix
from kvcdn_core.runtime_defaults import DEFAULT_QUESTION


@click.command("continue")
@model_options()
@click.option("--kv-path", required=True, help="Artifact to continue from.")
@click.option("--question", default=DEFAULT_QUESTION, show_default=True, help="Text fed after the context.")
@click.option("--n", "n", type=click.IntRange(1), default=64, show_default=True, help="Tokens to generate.")
@force_option
@format_option
def command(model, revision, device, dtype, quiet, kv_path, question, n, force, fmt):
    """Load an artifact, feed QUESTION after its context and generate N tokens greedily."""
    from kvcdn_core import runtime

    session, header = open_artifact(ensure_kv_suffix(kv_path), model, revision, device, dtype)
    cache, context_ids = runtime.load_cache(session, header, force=force)
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    ids, _ = runtime.greedy(session, cache, question_ids, n)
    text = runtime.decode(session, ids)
    if fmt == "json":
        emit_json({"path": str(header.path), "model": session.model_ref, "reused_tokens": len(context_ids),
                   "question_tokens": len(question_ids), "token_ids": ids, "text": text})
    else:
        click.echo(text)
