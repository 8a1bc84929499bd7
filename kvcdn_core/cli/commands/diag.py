"""``kvcdn diag``: where and how much the cached path differs from a full prefill, logit by logit."""

from __future__ import annotations

import click

from kvcdn_core.cli.commands.common import composition_knobs, composition_options
from kvcdn_core.cli.commands.verify import check_options, prepare
from kvcdn_core.cli.render import emit_json
from kvcdn_core.errors import CheckFailed, KvcdnError


@click.command("diag")
@check_options
@composition_options(auto=True)
@click.option(
    "--max-logit-diff",
    type=float,
    default=1e-3,
    show_default=True,
    help="Exit 1 when any step's max absolute logit difference exceeds this.",
)
@click.option(
    "--max-kl",
    type=click.FloatRange(0.0),
    default=None,
    help="With --recompute auto: the largest mean KL accepted; the check is then this, not --max-logit-diff.",
)
def command(
    model,
    revision,
    device,
    dtype,
    quiet,
    kv_path,
    context_file,
    question,
    n,
    recompute,
    rule,
    force,
    fmt,
    max_logit_diff,
    max_kl,
):
    """Compare the two verify paths at the logits level, step by step.

    Both paths are fed the reference's tokens (teacher forcing), so every step compares the same
    inputs: argmax agreement, max absolute logit difference, KL(reference || cached), top-5 overlap.
    With --kv-path repeated, the cached path is the artifacts composed (--recompute, --select);
    --recompute auto --max-kl X tries the shares 0, 0.05, 0.15, 0.3, 0.5, 1 and reports the first
    whose mean KL is within X.
    """
    from kvcdn_core.exactness.against_prefill import run_diag, run_diag_composed, summary

    recompute, rule = composition_knobs(kv_path, recompute, rule)
    if (recompute == "auto") != (max_kl is not None):
        raise KvcdnError("--recompute auto and --max-kl go together")
    session, header = prepare("diag", model, revision, device, dtype, quiet, kv_path, context_file)
    tried: list[dict] = []
    if isinstance(header, list):
        steps, composition, tried = run_diag_composed(
            session, header, question, n, recompute, rule, force=force, max_kl=max_kl
        )
        where = {"paths": [str(h.path) for h in header], **composition.as_dict()}
        click.echo(composition.summary(), err=True)
    else:
        steps = run_diag(session, header, question, n, force=force)
        where = {"path": str(header.path)}
    worst = max(s["max_abs_logit_diff"] for s in steps)
    figures = summary(steps)
    agree = figures["argmax_agree"]
    passed = worst <= max_logit_diff if max_kl is None else figures["mean_kl"] <= max_kl
    if fmt == "json":
        auto = {"tried": tried, "max_kl": max_kl} if max_kl is not None else {}
        emit_json(
            {
                **where,
                "model": session.model_ref,
                "steps": steps,
                **figures,
                "max_abs_logit_diff": worst,
                "threshold": max_logit_diff,
                **auto,
                "status": "PASS" if passed else "FAIL",
            }
        )
    else:
        for t in tried if max_kl is not None else []:
            click.echo(f"--recompute {t['recompute']:g}: mean KL {t['mean_kl']:.2e}, argmax {t['argmax_agree']}/{n}")
        click.echo(f"{'step':>4} {'token':>7} {'argmax':>6} {'max|dlogit|':>12} {'KL':>10} {'top5':>5}")
        for s in steps:
            click.echo(
                f"{s['step']:>4} {s['token']:>7} {'yes' if s['argmax_agree'] else 'NO':>6} "
                f"{s['max_abs_logit_diff']:>12.3e} {s['kl_divergence']:>10.2e} {s['top5_overlap']:>5.1f}"
            )
        first = figures["first_divergence"]
        click.echo(
            f"first divergence: {'none' if first is None else f'step {first}'}, mean KL {figures['mean_kl']:.2e}, "
            f"mean top-5 overlap {figures['mean_top5_overlap']:.2f}"
        )
        if max_kl is None:
            click.echo(
                f"argmax agreement {agree}/{len(steps)}, max |dlogit| {worst:.3e} "
                f"(threshold {max_logit_diff:g}): {'PASS' if passed else 'FAIL'}"
            )
        else:
            click.echo(
                f"chosen --recompute {tried[-1]['recompute']:g}: mean KL {figures['mean_kl']:.2e} "
                f"(max {max_kl:g}): {'PASS' if passed else 'FAIL'}"
            )
    if not passed:
        if max_kl is not None:
            raise CheckFailed(f"no share reaches mean KL {max_kl:g}; the full prefill gave {figures['mean_kl']:.2e}")
        raise CheckFailed(f"max logit difference {worst:.3e} exceeds {max_logit_diff:g}")
