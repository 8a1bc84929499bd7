"""``kvcdn benchmark``: time a full prefill against loading the cached context from disk."""

from __future__ import annotations

import click

from kvcdn_core import notices
from kvcdn_core.cli.commands.common import (
    check_new_output,
    force_output_option,
    format_option,
    model_options,
    read_text_file,
)
from kvcdn_core.cli.render import emit_json
from kvcdn_core.model.defaults import DEFAULT_MODEL, DEFAULT_QUESTION


@click.command("benchmark")
@model_options(from_artifact=False)
@click.option(
    "--lengths", default="255,485,945,1888,3774", show_default=True, help="Context lengths in tokens, comma-separated."
)
@click.option(
    "--reps",
    type=click.IntRange(1),
    default=5,
    show_default=True,
    help="Timed runs per measurement, after one discarded warm-up; medians are reported "
    "(min and max too with --format json).",
)
@click.option(
    "--threads",
    type=click.IntRange(1),
    default=None,
    help="Torch threads for every timed run [default: the physical cores]; printed with the results.",
)
@click.option(
    "--context-file",
    default=None,
    help="UTF-8 document to cut the contexts from [default: a synthetic text, said in the output].",
)
@click.option(
    "--scheme",
    "schemes",
    default="none",
    show_default=True,
    help="Comma-separated artifact schemes: none and any installed quantizer (e.g. none,int8).",
)
@click.option(
    "--question",
    default=DEFAULT_QUESTION,
    help=f"Text fed after the cached context for the time to first token [default: {DEFAULT_QUESTION!r}].",
)
@click.option(
    "--page-cache",
    type=click.Choice(["file", "auto", "system", "keep"]),
    default="file",
    show_default=True,
    help="How loads are made cold: file = fadvise(DONTNEED) on the artifact only (checked with "
    "mincore); system = drop the whole host's page cache (root; affects other processes); "
    "auto = system where permitted, else file; keep = do not drop (warm loads).",
)
@click.option(
    "--output", "-o", default=None, help="CSV path [default: $XDG_DATA_HOME/kvcdn/benchmark/<ms>-<model>-bench.csv]."
)
@force_output_option
@click.option("--wide", is_flag=True, help="Print every measured column (the CSV and --format json always have them).")
@format_option
def command(
    model,
    revision,
    device,
    dtype,
    quiet,
    lengths,
    reps,
    threads,
    context_file,
    schemes,
    question,
    page_cache,
    output,
    force,
    wide,
    fmt,
):
    """Measure prefill against a cached continuation for several context lengths.

    For each length: the full prefill (prefill_s), one decode step on the resident cache
    (kv_attn_s); and for each scheme: loading the artifact from a cold file and rebuilding the cache
    (load_s), load + the question + the first token (ttft_cached_s), the same with the load
    pipelined under the question's forward (ttft_pipelined_s), and the limits they are held to: a
    plain read of the file (plain_read_s) and the question on the resident cache (question_s). One
    discarded warm-up, then REPS runs, medians. Writes a CSV (plot it with `kvcdn plot`) and prints
    a table of the main columns within 100 characters (--wide: all of them).
    """
    from pathlib import Path

    from kvcdn_core import runtime
    from kvcdn_core.artifact.pagecache import PageCache
    from kvcdn_core.benchmark import inputs, measure, report

    model = model or DEFAULT_MODEL
    wanted = inputs.parse_lengths(lengths)
    scheme_list = inputs.parse_schemes(schemes, inputs.installed_schemes())
    text = read_text_file(context_file) if context_file else None
    path = Path(output) if output else report.default_csv_path(model)
    check_new_output(path, force)
    session = runtime.load_session(model, revision, device, dtype)
    inputs.check_lengths(session, wanted)
    ids, source = inputs.context_ids(session, text, max(wanted))
    with measure.scratch_dir(path.parent) as work:
        result = measure.run_benchmark(
            session,
            ids,
            wanted,
            reps,
            scheme_list,
            work,
            question,
            PageCache(page_cache),
            source,
            progress=not quiet,
            threads=threads,
        )
    report.write_csv(result.rows, path)
    if fmt == "json":
        emit_json(report.as_json(result, session, reps, path))
    else:
        click.echo(report.summary(result, session, reps, path, wide))
    for message in report.warnings(result.rows):
        notices.warn(message)
