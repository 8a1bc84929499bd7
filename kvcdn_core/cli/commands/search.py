"""``kvcdn search``: which saved artifacts share the longest token prefix with a query.

Searching needs the model's tokenizer only (no weights, no torch); ``--tree`` loads the model to
continue from the best artifact.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvcdn_core.cli.commands.common import force_option, format_option, model_options, text_or_file
from kvcdn_core.cli.render import emit_json, print_table
from kvcdn_core.errors import KvcdnError


@click.command("search")
@model_options()
@click.option(
    "--dir",
    "directory",
    default=None,
    help="Directory searched recursively for .kv artifacts [default: $XDG_DATA_HOME/kvcdn, "
    "where generate writes by default].",
)
@click.option(
    "--store",
    "store",
    default=None,
    help="Look the query up in this chunk store's prefix index instead (a path, file://, s3://...).",
)
@click.option("--prompt", "query", default=None, help="Text whose longest saved token prefix is wanted.")
@click.option("--prompt-file", "query_file", default=None, help="Read the prompt from a UTF-8 file instead.")
@click.option("--query", "old_query", default=None, hidden=True)  # old names: one release with a warning
@click.option("--query-file", "old_query_file", default=None, hidden=True)
@click.option("--limit", type=click.IntRange(1), default=10, show_default=True, help="Rows to show.")
@click.option(
    "--tree",
    "tree_n",
    type=click.IntRange(1, 256),
    default=None,
    help="Also continue the query from the best artifact with N distinct candidates.",
)
@click.option(
    "--tree-tokens", type=click.IntRange(1), default=32, show_default=True, help="Tokens per --tree candidate."
)
@force_option
@format_option
def command(
    model,
    revision,
    device,
    dtype,
    quiet,
    directory,
    store,
    query,
    query_file,
    old_query,
    old_query_file,
    limit,
    tree_n,
    tree_tokens,
    force,
    fmt,
):
    """Rank the artifacts under DIR by the token prefix they share with the query.

    Reads only artifact headers and token ids, kept in a .kvcdn-index file per directory, and the
    model's tokenizer; compares only the artifacts that can match, found through the prefix index
    kept in DIR/.kvcdn-prefix; skips artifacts of other models by fingerprint. --model defaults to the one
    model the artifacts were made with. With --store: looks the query up in the store's prefix index
    (no artifact is read) and lists the artifacts sharing the longest prefix.
    """
    from kvcdn_core import search
    from kvcdn_core.paths import data_home

    if old_query is not None or old_query_file is not None:
        from kvcdn_core import notices

        notices.warn("search --query/--query-file are deprecated; use --prompt/--prompt-file, as continue")
        query = query if query is not None else old_query
        query_file = query_file if query_file is not None else old_query_file
    text = text_or_file(query, query_file, "prompt")
    if store is not None:
        if directory is not None:
            raise KvcdnError("pass one of --dir and --store")
        return _search_store(model, revision, device, dtype, quiet, store, text, limit, tree_n, tree_tokens, force, fmt)
    directory = directory or str(data_home())
    found = search.search(directory, text, model, revision)
    out = {
        "directory": directory,
        "model": found.model_ref,
        "query_tokens": len(found.query_ids),
        "start_tokens": found.start_tokens,
        "tokenizer": getattr(found.tokenizer, "kind", "transformers"),
        "artifacts_scanned": found.ranking.same_model,
        "skipped_other_models": found.ranking.foreign,
        "matches": [m.as_dict() for m in found.ranking.matches[:limit]],
    }
    pre = candidates = None
    if tree_n:
        session, found = search.session_for_search(found, revision, device, dtype)
        pre = search.prefill_reusing(session, found.ranking, found.query_ids, progress=not quiet, force=force)
        candidates = search.tree(session, pre, tree_n, tree_tokens)
        out["tree"] = {**pre.as_dict(), "candidates": [c.as_dict() for c in candidates]}
    if fmt == "json":
        emit_json(out)
        return
    _print_table(found, out, limit)
    if candidates is not None:
        click.echo(pre.summary())
        for i, c in enumerate(candidates, 1):
            click.echo(f"[{i}] logprob {c.first_token_logprob:8.4f}  {c.text!r}")


def _search_store(model, revision, device, dtype, quiet, store, text, limit, tree_n, tree_tokens, force, fmt):
    import tempfile

    from kvcdn_core import search
    from kvcdn_core.search.store import fetch_best, search_store

    found = search_store(store, text, model, revision, limit)
    out = found.as_dict(limit)
    pre = candidates = None
    if tree_n:
        with tempfile.TemporaryDirectory(prefix="kvcdn-store-") as tmp:
            local = fetch_best(found, Path(tmp))
            session, local = search.session_for_search(local, revision, device, dtype)
            pre = search.prefill_reusing(session, local.ranking, local.query_ids, progress=not quiet, force=force)
        candidates = search.tree(session, pre, tree_n, tree_tokens)
        tree = {**pre.as_dict(), "candidates": [c.as_dict() for c in candidates]}
        tree["artifact"] = Path(tree["artifact"]).stem if tree["artifact"] else None
        out["tree"] = tree
    if fmt == "json":
        emit_json(out)
        return
    summary = f"query: {len(found.query_ids)} tokens; looked up in {store} ({found.roots} root(s) of {found.model_ref})"
    if not out["matches"]:
        click.echo(f"no match: no artifact in {store} shares a token prefix with the query ({summary})")
    else:
        rows = [("NAME", "PREFIX", "TOKENS", "USABLE", "REUSE", "DTYPE")]
        for m in out["matches"]:
            rows.append(
                (
                    m["name"],
                    str(m["prefix_tokens"]),
                    str(m["artifact_tokens"]),
                    str(m["usable_tokens"]),
                    m["reuse"],
                    str(m["quantization"] or m["compute_dtype"]),
                )
            )
        print_table(rows, right=(1, 2, 3))
        click.echo(summary)
    if candidates is not None:
        click.echo(pre.summary())
        for i, c in enumerate(candidates, 1):
            click.echo(f"[{i}] logprob {c.first_token_logprob:8.4f}  {c.text!r}")


def _print_table(found, out, limit) -> None:
    r = found.ranking
    skipped = f", skipped {r.foreign} of other models" if r.foreign else ""
    summary = f"query: {len(found.query_ids)} tokens; {r.same_model} artifact(s) of {found.model_ref} searched{skipped}"
    if not r.matches:
        click.echo(f"no match: no artifact under {out['directory']} shares a token prefix with the query ({summary})")
        return
    rows = [("PATH", "PREFIX", "TOKENS", "USABLE", "REUSE", "MODEL")]
    for m in out["matches"]:
        rows.append(
            (
                m["path"],
                str(m["prefix_tokens"]),
                str(m["artifact_tokens"]),
                str(m["usable_tokens"]),
                m["reuse"],
                str(m["model"]),
            )
        )
    print_table(rows, right=(1, 2, 3))
    more = len(r.matches) - len(out["matches"])
    click.echo(summary + (f"; {more} more match(es), see --limit" if more > 0 else ""))
