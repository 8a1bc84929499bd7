"""``kvcdn plot``: the break-even reuse count of a benchmark, as a chart and a table."""

from __future__ import annotations

import click

from kvcdn_core.cli.commands.common import check_new_output, force_output_option, format_option
from kvcdn_core.cli.render import emit_json


@click.command("plot")
@click.option(
    "--csv-path", default=None, help="Benchmark CSV [default: the newest one in $XDG_DATA_HOME/kvcdn/benchmark/]."
)
@click.option(
    "--model", default=None, help="Model name for the title and file name; also picks the newest CSV of that model."
)
@click.option(
    "--output",
    "-o",
    "out",
    default=None,
    help="PNG path [default: $XDG_DATA_HOME/kvcdn/plot/<ms>-<model>-amortized-cost.png].",
)
@click.option("--out", "old_out", default=None, hidden=True)  # the old name, one release with a warning
@click.option(
    "--max-n", type=int, default=1000, show_default=True, help="Largest reuse count on the x axis (at least 2)."
)
@force_output_option
@format_option
def command(csv_path, model, out, old_out, max_n, force, fmt):
    """Plot amortized cost per call against the reuse count N, with the break-even N* marked.

    Per context length: C_prefill every call without a cache, C_prefill/N + C_load with one, and
    N* = C_prefill / (C_prefill - C_load) where they meet. Writes an 840x600 PNG, prints the table.
    """
    from pathlib import Path

    from kvcdn_core import notices
    from kvcdn_core.benchmark import plot

    if old_out is not None:
        notices.warn("plot --out is deprecated; use --output (-o), as every command that writes a file")
        out = out or old_out
    plot.check_max_n(max_n)
    source = Path(csv_path) if csv_path else plot.newest_csv(model)
    costs = plot.read_costs(source)
    noisy = plot.non_monotonic(costs)
    for line in noisy:
        notices.warn(line)
    name = model or plot.model_in_csv(source)
    title = "Amortized cost per call vs reuse count N" + (f"\n{name}" if name else f"\n{source.name}")
    path = Path(out) if out else plot.default_png_path(name)
    check_new_output(path, force, "--output")
    plot.write_png(plot.render_png(costs, max_n, title), path)
    if fmt == "json":
        emit_json(
            {
                "csv": str(source),
                "png": str(path),
                "title": title,
                "max_n": max_n,
                "non_monotonic": noisy,
                "rows": [c.as_dict(max_n) for c in costs],
            }
        )
    else:
        click.echo(plot.table(costs, max_n))
        click.echo(f"read {source}")
        click.echo(f"wrote {path}")
