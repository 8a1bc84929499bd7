"""``kvcdn diag``: where and how much the cached path differs from a full prefill, logit by logit."""

from __future__ import annotations

import click

from kvcdn_core.cli.commands.verify import check_options, prepare
from kvcdn_core.cli.render import emit_json
from kvcdn_core.errors import CheckFailed


@click.command("diag")
@check_options
@click.option(
    "--max-logit-diff",
    type=float,
    default=1e-3,
    show_default=True,
    help="Exit 1 when any step's max absolute logit difference exceeds this.",
)
def command(model, revision, device, dtype, quiet, kv_path, context_file, question, n, force, fmt, max_logit_diff):
    """Compare the two verify paths at the logits level, step by step.

    Both paths are fed the reference's tokens (teacher forcing), so every step compares the same
    inputs: argmax agreement, max absolute logit difference, KL(reference || cached), top-5 overlap.
    """
    from kvcdn_core.exactness.against_prefill import run_diag

    session, header = prepare("diag", model, revision, device, dtype, quiet, kv_path, context_file)
    steps = run_diag(session, header, question, n, force=force)
    worst = max(s["max_abs_logit_diff"] for s in steps)
    agree = sum(s["argmax_agree"] for s in steps)
    passed = worst <= max_logit_diff
    if fmt == "json":
        emit_json(
            {
                "path": str(header.path),
                "model": session.model_ref,
                "steps": steps,
                "argmax_agree": agree,
                "max_abs_logit_diff": worst,
                "threshold": max_logit_diff,
                "status": "PASS" if passed else "FAIL",
            }
        )
    else:
        click.echo(f"{'step':>4} {'token':>7} {'argmax':>6} {'max|dlogit|':>12} {'KL':>10} {'top5':>5}")
        for s in steps:
            click.echo(
                f"{s['step']:>4} {s['token']:>7} {'yes' if s['argmax_agree'] else 'NO':>6} "
                f"{s['max_abs_logit_diff']:>12.3e} {s['kl_divergence']:>10.2e} {s['top5_overlap']:>5.1f}"
            )
        click.echo(
            f"argmax agreement {agree}/{len(steps)}, max |dlogit| {worst:.3e} "
            f"(threshold {max_logit_diff:g}): {'PASS' if passed else 'FAIL'}"
        )
    if not passed:
        raise CheckFailed(f"max logit difference {worst:.3e} exceeds {max_logit_diff:g}")
