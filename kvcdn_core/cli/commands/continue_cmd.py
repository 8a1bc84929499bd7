"""``kvcdn continue``: the local inference path, continuing from a saved artifact.

Two ways in: ``--kv-path`` + ``--question`` feeds a question after one artifact's context (after
several artifacts' contexts composed in the order given, with ``--kv-path`` repeated: see
:mod:`kvcdn_core.compose`); ``--dir`` + ``--prompt-file`` takes a whole prompt, finds the artifact
with the longest usable prefix of it, reuses that prefix and prefills only the rest (token-exact
with a full prefill).
"""

from __future__ import annotations

from pathlib import Path

import click

from kvcdn_core.cli.commands.common import (
    composition_knobs,
    composition_options,
    force_option,
    format_option,
    model_options,
    open_artifact,
    open_artifacts,
    text_or_file,
)
from kvcdn_core.cli.render import emit_json
from kvcdn_core.errors import KvcdnError
from kvcdn_core.model.defaults import DEFAULT_QUESTION
from kvcdn_core.paths import input_artifact


@click.command("continue")
@model_options()
@click.option(
    "--kv-path",
    multiple=True,
    help="Artifact to continue from (with --question); repeat it to compose several documents in that order.",
)
@click.option(
    "--question", default=None, help=f"Text fed after the artifact's context [default: {DEFAULT_QUESTION!r}]."
)
@click.option(
    "--dir",
    "directory",
    default=None,
    help="Search this directory for the artifact sharing the longest prefix with --prompt-file "
    "[default: $XDG_DATA_HOME/kvcdn].",
)
@click.option(
    "--store",
    "store",
    default=None,
    help="Look the prompt up in this chunk store's prefix index and fetch the best artifact from it.",
)
@click.option("--prompt", default=None, help="The whole prompt (with --dir or --store).")
@click.option("--prompt-file", default=None, help="Read the prompt from a UTF-8 file instead.")
@click.option("--n", "n", type=click.IntRange(1), default=64, show_default=True, help="Tokens to generate.")
@composition_options()
@force_option
@format_option
def command(
    model,
    revision,
    device,
    dtype,
    quiet,
    kv_path,
    question,
    directory,
    store,
    prompt,
    prompt_file,
    n,
    recompute,
    rule,
    force,
    fmt,
):
    """Generate N tokens greedily, continuing from a saved artifact.

    With --kv-path: load the artifact and feed QUESTION after its context. With --kv-path repeated:
    compose the artifacts' documents in that order (keys moved to their new positions, a share
    --recompute of the later documents' tokens recomputed), then feed QUESTION. With --prompt or
    --prompt-file (and --dir or --store): reuse the best saved artifact's usable prefix of the prompt, prefill the rest, and
    report how many prompt tokens were reused; the output is the same as a full prefill's.
    """
    if directory is not None or store is not None or prompt is not None or prompt_file is not None:
        if kv_path or question is not None or recompute is not None or rule is not None:
            raise KvcdnError("--dir/--prompt-file and --kv-path/--question are two modes; pass one pair")
        if prompt is None and prompt_file is None:
            raise KvcdnError(f"--{'store' if store is not None else 'dir'} needs --prompt or --prompt-file")
        if directory is not None and store is not None:
            raise KvcdnError("pass one of --dir and --store")
        text = text_or_file(prompt, prompt_file, "prompt")
        return _continue_prompt(model, revision, device, dtype, quiet, directory, store, text, n, force, fmt)
    if not kv_path:
        raise KvcdnError("pass --kv-path (with --question), or --dir with --prompt-file")
    recompute, rule = composition_knobs(kv_path, recompute, rule)
    if len(kv_path) > 1:
        return _continue_composed(
            model, revision, device, dtype, kv_path, question or DEFAULT_QUESTION, n, recompute, rule, force, fmt
        )
    _continue_artifact(model, revision, device, dtype, kv_path[0], question or DEFAULT_QUESTION, n, force, fmt)


def _continue_composed(model, revision, device, dtype, paths, question, n, recompute, rule, force, fmt):
    from kvcdn_core import compose, runtime

    session, headers = open_artifacts(paths, model, revision, device, dtype)
    composed = compose.compose(session, headers, recompute, rule, force=force)
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    ids, _ = runtime.greedy(session, composed.cache, question_ids, n)
    text = runtime.decode(session, ids)
    if fmt == "json":
        emit_json(
            {
                "paths": [str(h.path) for h in headers],
                "model": session.model_ref,
                **composed.as_dict(),
                "question_tokens": len(question_ids),
                "token_ids": ids,
                "text": text,
            }
        )
    else:
        click.echo(composed.summary(), err=True)
        click.echo(text)


def _continue_artifact(model, revision, device, dtype, kv_path, question, n, force, fmt):
    from kvcdn_core import runtime

    session, header = open_artifact(input_artifact(kv_path, "--kv-path"), model, revision, device, dtype)
    # Streamed: the question's forward starts on the first layers while the later ones are read.
    cache, context_ids = runtime.load_cache(session, header, force=force, stream=True)
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    ids, _ = runtime.greedy(session, cache, question_ids, n)
    text = runtime.decode(session, ids)
    if fmt == "json":
        emit_json(
            {
                "path": str(header.path),
                "model": session.model_ref,
                "reused_tokens": len(context_ids),
                "question_tokens": len(question_ids),
                "token_ids": ids,
                "text": text,
            }
        )
    else:
        click.echo(text)


def _continue_prompt(model, revision, device, dtype, quiet, directory, store, prompt, n, force, fmt):
    import tempfile

    from kvcdn_core import runtime, search
    from kvcdn_core.paths import data_home

    with tempfile.TemporaryDirectory(prefix="kvcdn-store-") as tmp:
        if store is not None:  # the best artifact is fetched from the store, then continued as from a directory
            from kvcdn_core.search.store import fetch_best, search_store

            found = fetch_best(search_store(store, prompt, model, revision), Path(tmp))
        else:
            found = search.search(directory or str(data_home()), prompt, model, revision)
        session, found = search.session_for_search(found, revision, device, dtype)
        pre = search.prefill_reusing(session, found.ranking, found.query_ids, progress=not quiet, force=force)
    if store is not None and pre.path is not None:  # the temporary file is gone: name the artifact
        pre.path = Path(pre.path.stem)
    ids = runtime.decode_from(session, pre.cache, pre.logits, n)[0]
    text = runtime.decode(session, ids)
    if fmt == "json":
        emit_json(
            {
                **pre.as_dict(),
                "model": session.model_ref,
                "prompt_tokens": pre.query_tokens,
                "token_ids": ids,
                "text": text,
            }
        )
    else:
        click.echo(pre.summary("prompt"), err=True)
        click.echo(text)
