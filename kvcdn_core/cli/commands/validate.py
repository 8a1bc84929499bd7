"""``kvcdn validate``: every installed family's tiny configs (offline), or one real model, through the
reference path, the cache path and a bitwise round trip.

This replaces a hand-kept list of "validated" models: ``--format markdown`` prints the README's
support table from the same run (``tests/test_support_table.py`` checks the README against the
installed adapters).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import click

from kvcdn_core.artifact.manifest import LayerEntry, manifest_of
from kvcdn_core.cli.commands.common import read_text_file
from kvcdn_core.cli.render import emit_json, table_lines
from kvcdn_core.errors import CheckFailed, KvcdnError


@dataclasses.dataclass
class ArchReport:
    """One architecture's validation: who serves it, its cache layers, and each phase's result."""

    family: str
    requirement: str  # what to pip install for this family
    architecture: str
    source: str  # "tiny" or the model id
    phases: list = dataclasses.field(default_factory=list)  # PhaseResult
    layers: list = dataclasses.field(default_factory=list)  # LayerEntry of the manifest
    seconds: float = 0.0
    variant: str = "default"  # which tiny shape (kvcdn_core.model.tiny.config_variants)
    proven: dict = dataclasses.field(default_factory=dict)  # kvcdn_core.exactness.architecture.exercised

    @property
    def label(self) -> str:
        return self.architecture if self.variant == "default" else f"{self.architecture}[{self.variant}]"

    @property
    def passed(self) -> bool:
        return bool(self.phases) and all(p.passed for p in self.phases)

    def layer_summary(self) -> str:
        return summarize_layers(self.layers)

    def as_dict(self) -> dict:
        return {
            "family": self.family,
            "requirement": self.requirement,
            "architecture": self.architecture,
            "variant": self.variant,
            "source": self.source,
            "passed": self.passed,
            "layers": self.layer_summary(),
            "layer_kinds": self.proven.get("layer_kinds", []),
            "features": self.proven.get("features", []),
            "shape": self.proven.get("shape", {}),
            "seconds": round(self.seconds, 3),
            "phases": [p.as_dict() for p in self.phases],
        }


def summarize_layers(layers: list[LayerEntry]) -> str:
    """``2 full_attention, 2 sliding_window(16)``: counts of each layer kind, in first-seen order."""
    counts: dict[str, int] = {}
    for layer in layers:
        kind = layer.kind if layer.window is None else f"{layer.kind}({layer.window})"
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "-"


def installed_adapters() -> dict[str, dict[str, type]]:
    """family → architecture → adapter class, for every installed model plugin."""
    from kvcdn_core.plugin_host.registry import adapter_classes

    by_family: dict[str, dict[str, type]] = {}
    for arch, cls in adapter_classes().items():
        by_family.setdefault(cls.family, {})[arch] = cls
    return by_family


def _failed(run_arch: str, phase: str, exc: BaseException):
    from kvcdn_core.exactness.architecture import PhaseResult

    text = str(exc) if isinstance(exc, KvcdnError) else f"{type(exc).__name__}: {exc}"
    return PhaseResult(run_arch, phase, False, text.splitlines()[0] if text else type(exc).__name__)


def validate_one(session, report: ArchReport, workdir: Path, n: int, context: str | None, **options) -> None:
    """Run every validation phase on a loaded session and fill ``report``."""
    from kvcdn_core.exactness.architecture import exercised, run_validation

    run, results = run_validation(session, report.architecture, workdir, n, context, **options)
    report.phases.extend(results)
    if run.header is not None:
        report.layers = list(manifest_of(run.header).layers)
    report.proven = exercised(session.model.config, report.layers)


def validate_tiny_arch(family: str, arch: str, cls, workdir: Path, n: int) -> list[ArchReport]:
    """One report per tiny variant of ``arch`` (see :func:`kvcdn_core.model.tiny.config_variants`)."""
    from kvcdn_core.model.tiny import config_variants

    if arch not in (cls.validation_configs or {}):
        from kvcdn_core.exactness.architecture import PhaseResult

        report = ArchReport(family, cls.install_requirement(), arch, "tiny")
        report.phases.append(PhaseResult(arch, "load", False, "the adapter ships no tiny validation config"))
        return [report]
    return [
        validate_tiny_variant(family, arch, cls, variant, workdir / variant, n)
        for variant in config_variants(cls, arch)
    ]


def validate_tiny_variant(family: str, arch: str, cls, variant: str, workdir: Path, n: int) -> ArchReport:
    from kvcdn_core import runtime
    from kvcdn_core.exactness.architecture import tiny_options
    from kvcdn_core.model.tiny import build_tiny_model

    report = ArchReport(family, cls.install_requirement(), arch, "tiny", variant=variant)
    start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = build_tiny_model(cls, arch, workdir / arch, variant=variant)
        session = runtime.load_session(str(model_dir), device="cpu", dtype="float32", adapter_cls=cls)
    except Exception as exc:
        report.phases.append(_failed(arch, "load", exc))
    else:
        validate_one(session, report, workdir, n, None, **tiny_options(n))
    report.seconds = time.perf_counter() - start
    return report


def validate_model(
    model: str, revision, device: str, dtype: str, workdir: Path, n: int, context: str | None
) -> ArchReport:
    from kvcdn_core import runtime

    start = time.perf_counter()
    session = runtime.load_session(model, revision, device, dtype)  # refusals exit 2 here
    arch = session.fingerprint.get("architecture") or type(session.model).__name__
    report = ArchReport(session.adapter.family, session.adapter.install_requirement(), arch, model)
    validate_one(session, report, workdir, n, context)
    report.seconds = time.perf_counter() - start
    return report


# -- output -------------------------------------------------------------------------------------


def phase_names(reports: list[ArchReport]) -> list[str]:
    names: list[str] = []
    for r in reports:
        for p in r.phases:
            if p.phase not in names:
                names.append(p.phase)
    return names


def _cell(phase) -> str:
    if phase is None:
        return "-"
    status = "PASS" if phase.passed else "FAIL"
    if phase.first_divergence is not None:
        status += f"@{phase.first_divergence}"
    return f"{status} {phase.seconds:.2f}s"


def render_table(reports: list[ArchReport], wide: bool = False) -> str:
    """The table for people: one row per architecture and shape, failures spelled out below.

    Narrow (the default, within 100 columns): one CHECKS cell per row, ``PASS 5/5`` or the first
    failed phase (``FAIL cache@3``). ``wide``: a column per phase with its seconds, and the layers.
    """
    names = phase_names(reports)
    if wide:
        rows = [["FAMILY", "ARCHITECTURE", *[n.upper() for n in names], "LAYERS", "TOTAL"]]
        for r in reports:
            by_name = {p.phase: p for p in r.phases}
            rows.append(
                [r.family, r.label, *[_cell(by_name.get(n)) for n in names], r.layer_summary(), f"{r.seconds:.1f}s"]
            )
    else:
        rows = [["FAMILY", "ARCHITECTURE", "CHECKS", "TOTAL"]]
        for r in reports:
            rows.append([r.family, r.label, _checks(r), f"{r.seconds:.1f}s"])
    lines = table_lines(rows)
    failures = [(r, p) for r in reports for p in r.phases if not p.passed]
    for r, p in failures:
        where = "" if p.first_divergence is None else f" (first divergence at token {p.first_divergence})"
        lines.append(f"{r.label} {p.phase}: {p.detail}{where}")
    lines.append(pass_line(reports))
    return "\n".join(lines)


def _checks(report: ArchReport) -> str:
    """``PASS 5/5``, or the first failed phase: ``FAIL cache@3`` (at its first divergent token)."""
    failed = [p for p in report.phases if not p.passed]
    if not failed:
        return f"PASS {len(report.phases)}/{len(report.phases)}" if report.phases else "-"
    first = failed[0]
    at = "" if first.first_divergence is None else f"@{first.first_divergence}"
    return f"FAIL {first.phase}{at}"


def pass_line(reports: list[ArchReport]) -> str:
    """``65/65 architectures pass (108/108 shapes)``: an architecture, counted once by its name,
    passes when every one of its tiny shapes does."""
    if not reports:
        return "0/0 architectures pass (none installed)"
    names = list(dict.fromkeys(r.architecture for r in reports))
    failed = {r.architecture for r in reports if not r.passed}
    shapes = sum(r.passed for r in reports)
    return f"{len(names) - len(failed)}/{len(names)} architectures pass ({shapes}/{len(reports)} shapes)"


def _shape_text(shape: dict) -> str:
    """``4q/2kv×16``: query heads, key-value heads and head width of one validated shape."""
    if not shape:
        return "-"
    return f"{shape.get('heads')}q/{shape.get('kv_heads')}kv×{shape.get('head_dim')}"


def render_markdown(reports: list[ArchReport]) -> str:
    """The README's support table: one row per architecture (all its tiny shapes), sorted by family.

    *Proven* lists the features the passing runs exercised (kvcdn_core.exactness.architecture.exercised) and
    *Shapes* the attention shapes validated (query heads / key-value heads × head width).
    """
    by_arch: dict[tuple[str, str], list[ArchReport]] = {}
    for r in reports:
        by_arch.setdefault((r.family, r.architecture), []).append(r)
    lines = [
        "| Architecture | Family | Install | Cache layers (tiny config) | Proven | Shapes | `kvcdn validate` |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (family, arch), group in sorted(by_arch.items()):
        first = group[0]
        features = sorted({f for r in group for f in r.proven.get("features", [])})
        shapes = sorted({_shape_text(r.proven.get("shape", {})) for r in group})
        status = "PASS" if all(r.passed for r in group) else "FAIL"
        if len(group) > 1:
            status += f" ({len(group)} shapes)"
        lines.append(
            f"| `{arch}` | {family} | `pip install '{first.requirement}'` | "
            f"{first.layer_summary()} | {', '.join(features) or '-'} | {', '.join(shapes)} | {status} |"
        )
    return "\n".join(lines)


@click.command("validate")
@click.option("--family", default=None, help="Validate only this installed family's tiny configs.")
@click.option(
    "--model",
    default=None,
    help="Validate one real model (Hugging Face id or local directory) instead of the tiny configs.",
)
@click.option("--revision", default=None, help="Model revision (with --model).")
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda", "mps"]),
    default="auto",
    show_default=True,
    help="Where to run --model (tiny configs always run on the CPU in float32).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="Compute dtype for --model; auto is float32 on CPU, bfloat16 on CUDA.",
)
@click.option(
    "--context-file",
    default=None,
    help="Context for --model [default: sample text longer than twice its sliding window].",
)
@click.option(
    "--n", "n", type=click.IntRange(1), default=16, show_default=True, help="Tokens to decode greedily on both paths."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "markdown"]),
    default="table",
    show_default=True,
    help="table for people, json for tools, markdown for the README support table.",
)
@click.option("--wide", is_flag=True, help="table: a column per phase with its seconds, and the cache layers.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def command(family, model, revision, device, dtype, context_file, n, fmt, wide, quiet):
    """Check that every installed architecture (or one model) continues token-exact from its cache.

    For each architecture: build the family's tiny offline config (or load --model), generate an
    artifact of a context longer than any sliding window, and run the phases: roundtrip (every
    tensor reloads bitwise), reference (full prefill + greedy decoding), cache (load the artifact,
    continue, compare token ids with the reference), and any that quantizers add. Exit 0 when all
    pass, 1 when any fails, 2 for an unknown family or a model no plugin serves.

    \b
      kvcdn validate                      # every installed family, offline
      kvcdn validate --family gemma
      kvcdn validate --model ./my-model --n 32
      kvcdn validate --format markdown    # the README support table
    """
    if family and model:
        raise KvcdnError("pass --family or --model, not both")
    if context_file and not model:
        raise KvcdnError("--context-file goes with --model (tiny configs use their own context)")
    context = read_text_file(context_file) if context_file else None
    say = (lambda line: None) if quiet else (lambda line: click.echo(line, err=True))

    with tempfile.TemporaryDirectory(prefix="kvcdn-validate-") as tmp:
        workdir = Path(tmp)
        if model:
            say(f"validating {model} ...")
            reports = [validate_model(model, revision, device, dtype, workdir, n, context)]
        else:
            reports = _validate_families(family, workdir, n, say)

    if fmt == "json":
        emit_json({"passed": all(r.passed for r in reports), "architectures": [r.as_dict() for r in reports]})
    elif fmt == "markdown":
        click.echo(render_markdown(reports))
    else:
        click.echo(render_table(reports, wide))
    failed = list(dict.fromkeys(r.architecture for r in reports if not r.passed))
    if failed:
        total = len({r.architecture for r in reports})
        raise CheckFailed(f"validation failed for {len(failed)} of {total} architectures: {', '.join(failed)}")


def _validate_families(family: str | None, workdir: Path, n: int, say) -> list:
    adapters = installed_adapters()
    if family is not None and family not in adapters:
        installed = ", ".join(sorted(adapters)) or "none"
        raise KvcdnError(f"unknown family '{family}'; installed families: {installed}")
    reports = []
    for fam in sorted(adapters) if family is None else [family]:
        for arch, cls in sorted(adapters[fam].items()):
            say(f"validating {fam}/{arch} ...")
            for report in validate_tiny_arch(fam, arch, cls, workdir, n):
                say(f"  {report.variant}: {'PASS' if report.passed else 'FAIL'} in {report.seconds:.1f}s")
                reports.append(report)
    return reports
