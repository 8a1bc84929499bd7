"""Validation of one architecture: the reference path, the cache path (save, load, continue) and
a bitwise round trip of every tensor. Shared by ``kvcdn validate`` and the contract test suite.

Phases are data: :data:`PHASES` lists ``(name, function)`` pairs run in order on one
:class:`ValidationRun`; each function returns a :class:`PhaseResult`. Another check (a quantized
path, say) is one more function appended to :data:`PHASES`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcdn_core import artifact, runtime
from kvcdn_core.artifact.manifest import LayerEntry
from kvcdn_core.errors import KvcdnError
from kvcdn_core.model.defaults import DEFAULT_QUESTION


@dataclasses.dataclass
class PhaseResult:
    architecture: str
    phase: str  # roundtrip | reference | cache | (quant schemes add their own)
    passed: bool
    detail: str = ""
    first_divergence: int | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ValidationRun:
    """What the phases of one architecture share: the session, the artifact, the reference tokens."""

    session: Any
    architecture: str
    workdir: Path
    n: int = 16
    context: str = ""
    question: str = DEFAULT_QUESTION
    #: Fail the reference phase when greedy output has fewer distinct tokens (tiny random models:
    #: a degenerate output would let a broken cache pass). 0 for real models.
    min_distinct: int = 0
    #: Fail the reference phase when the output is the same without the context (tiny models: a
    #: cache the continuation cannot see proves nothing).
    require_context_effect: bool = False
    path: Path | None = None
    header: Any = None
    context_ids: list[int] = dataclasses.field(default_factory=list)
    question_ids: list[int] = dataclasses.field(default_factory=list)
    reference_ids: list[int] | None = None

    def result(
        self, phase: str, passed: bool, detail: str, first_divergence: int | None = None, seconds: float = 0.0
    ) -> PhaseResult:
        return PhaseResult(self.architecture, phase, passed, detail, first_divergence, seconds)


def long_context(min_tokens: int, tokenizer) -> str:
    """Repeat-free text of at least ``min_tokens`` tokens, built from the sample text."""
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    paragraphs = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < min_tokens:
        text += f"Section {i}. " + paragraphs[i % len(paragraphs)] + "\n\n"
        i += 1
    return text


def context_length_for(session) -> int:
    """Long enough to cross every sliding window the model has (and at least 96 tokens)."""
    cfg = session.model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None) or 0
    return max(96, int(window) * 2 + 8)


def compare_roundtrip(session, header) -> tuple[bool, str]:
    """Load the artifact, export the rebuilt cache again, and compare every tensor bitwise."""
    import torch

    stored = artifact.load_tensors(header)
    cache, _ = runtime.load_cache(session, header)
    _, again = session.adapter.export_cache(session.model, cache)
    expected = set(stored) - {artifact.TOKEN_IDS}
    if set(again) != expected:
        return False, f"re-export names differ: {sorted(set(again) ^ expected)[:4]}"
    for name, tensor in again.items():
        if stored[name].dtype != tensor.dtype or not torch.equal(stored[name], tensor.cpu()):
            return False, f"tensor {name} changed in the round trip"
    return True, f"{len(again)} tensors bitwise equal"


# -- phases -------------------------------------------------------------------------------------


def phase_roundtrip(run: ValidationRun) -> PhaseResult:
    """Generate the artifact (chunked prefill, save) and check that every tensor reloads bitwise."""
    session = run.session
    run.path = run.workdir / f"{run.architecture}.kv"
    _, run.context_ids = runtime.generate(session, run.context, run.path, chunk=64, progress=False)
    run.header = artifact.read_header(run.path)
    ok, detail = compare_roundtrip(session, run.header)
    return run.result("roundtrip", ok, f"{detail}, {len(run.context_ids)} context tokens")


def phase_reference(run: ValidationRun) -> PhaseResult:
    """Path A: a full prefill of context ∥ question, then greedy decoding."""
    from kvcdn_core.exactness.against_prefill import reference

    run.question_ids = run.session.adapter.encode_continuation(run.session.tokenizer, run.question)
    ids, logits = reference(run.session, run.context_ids, run.question_ids, run.n)
    run.reference_ids = ids
    distinct = len(set(ids))
    margin = min(float(step.topk(2).values[0] - step.topk(2).values[1]) for step in logits)
    detail = f"{len(ids)} tokens, {distinct} distinct, smallest top-2 logit margin {margin:.3g}"
    if distinct < run.min_distinct:
        return run.result("reference", False, f"degenerate output: {detail} (want {run.min_distinct} distinct)")
    if run.require_context_effect:
        blind, _ = reference(run.session, [], run.question_ids, run.n)
        if blind == ids:
            return run.result("reference", False, f"the output does not depend on the context: {detail}")
    return run.result("reference", len(ids) == run.n, detail)


def phase_cache(run: ValidationRun) -> PhaseResult:
    """Path B: load the artifact from disk, feed the question, decode; compare ids with path A."""
    from kvcdn_core.exactness.against_prefill import VerifyResult, cached

    if run.header is None or run.reference_ids is None:
        return run.result("cache", False, "skipped: an earlier phase failed")
    ids, _, _ = cached(run.session, run.header, run.question_ids, run.n)
    res = VerifyResult(run.n, len(run.context_ids), len(run.question_ids), run.reference_ids, ids, "", "")
    return run.result(
        "cache",
        res.passed,
        f"token match {res.matches}/{run.n}, {res.context_tokens} context tokens",
        res.first_divergence,
    )


def phase_fork(run: ValidationRun) -> PhaseResult:
    """A fork of the loaded cache (:meth:`ModelAdapter.fork_cache`) continues exactly, and the cache
    it was forked from is bitwise what the artifact holds afterwards: requests on a resident cache
    cannot see each other."""
    import torch

    from kvcdn_core.exactness.against_prefill import VerifyResult

    if run.header is None or run.reference_ids is None:
        return run.result("fork", False, "skipped: an earlier phase failed")
    session = run.session
    resident, _ = runtime.load_cache(session, run.header)
    ids, _ = runtime.greedy(session, session.adapter.fork_cache(resident), run.question_ids, run.n)
    res = VerifyResult(run.n, len(run.context_ids), len(run.question_ids), run.reference_ids, ids, "", "")
    if not res.passed:
        return run.result("fork", False, f"token match {res.matches}/{run.n} on the fork", res.first_divergence)
    stored = artifact.load_tensors(run.header)
    _, after = session.adapter.export_cache(session.model, resident)
    changed = [name for name, t in after.items() if not torch.equal(stored[name], t.cpu())]
    if changed:
        return run.result("fork", False, f"continuing on the fork changed the original: {changed[0]}")
    return run.result("fork", True, f"token match {res.matches}/{run.n}, original unchanged")


#: (name, function) run in order; a later phase may rely on what an earlier one left on the run.
PHASES: list[tuple[str, Callable[[ValidationRun], PhaseResult]]] = [
    ("roundtrip", phase_roundtrip),
    ("reference", phase_reference),
    ("cache", phase_cache),
    ("fork", phase_fork),
]

# The quantized path (issue 4): int8, checked on every family's real cache; see kvcdn_core.quant.codec.
from kvcdn_core.quant.phase import validation_phase as _quant_phase  # noqa: E402

PHASES.append(("quant:int8", _quant_phase("int8")))


def run_phases(run: ValidationRun, phases=None) -> list[PhaseResult]:
    """Run each phase, timing it; a refusal or crash fails that phase with its message."""
    results = []
    for name, fn in phases or PHASES:
        start = time.perf_counter()
        try:
            res = fn(run)
        except KvcdnError as exc:
            res = run.result(name, False, str(exc))
        except Exception as exc:  # a model crash is a failed phase, not a crashed table
            res = run.result(name, False, f"{type(exc).__name__}: {exc}")
        res.seconds = time.perf_counter() - start
        results.append(res)
    return results


def run_validation(
    session,
    architecture: str,
    workdir: Path,
    n: int = 16,
    context: str | None = None,
    min_distinct: int = 0,
    question: str = DEFAULT_QUESTION,
    require_context_effect: bool = False,
    phases: tuple[str, ...] | None = None,
) -> tuple[ValidationRun, list[PhaseResult]]:
    """The phases of :data:`PHASES` (all, or those named in ``phases``) for a loaded model, on a
    context longer than its windows."""
    context = context or long_context(context_length_for(session), session.tokenizer)
    run = ValidationRun(
        session, architecture, Path(workdir), n, context, question, min_distinct, require_context_effect
    )
    chosen = [(name, fn) for name, fn in PHASES if phases is None or name in phases]
    return run, run_phases(run, chosen)


def validate_session(session, architecture: str, workdir: Path, n: int = 16, **options) -> list[PhaseResult]:
    """The phase results of :func:`run_validation`."""
    return run_validation(session, architecture, workdir, n, **options)[1]


#: Tiny random models must decode at least this many distinct tokens out of n for the check to mean
#: anything (a constant output matches whatever the cache holds).
TINY_MIN_DISTINCT = 4
#: A short question for tiny models: their 2 layers with a 16-token window see only ~30 tokens back,
#: and a longer question would hide the cached context from the continuation entirely.
TINY_QUESTION = "\nQ: Why?\nA:"


def tiny_options(n: int) -> dict:
    """The validate_session options that keep a tiny random model's check meaningful."""
    return dict(min_distinct=min(TINY_MIN_DISTINCT, n), question=TINY_QUESTION, require_context_effect=True)


def validate_tiny(
    adapter_cls, architecture: str, workdir: Path, n: int = 16, phases: tuple[str, ...] | None = None
) -> list[PhaseResult]:
    """Build every tiny variant of ``architecture`` and validate each offline.

    Phases of a variant other than ``default`` are named ``phase[variant]``.
    """
    from kvcdn_core.model.tiny import DEFAULT_VARIANT, build_tiny_model, config_variants

    results = []
    for variant in config_variants(adapter_cls, architecture):
        # The default variant keeps the plain layout (tests read <workdir>/<architecture>.kv).
        where = Path(workdir) if variant == DEFAULT_VARIANT else Path(workdir) / variant
        model_dir = build_tiny_model(adapter_cls, architecture, where / architecture, variant=variant)
        session = runtime.load_session(str(model_dir), device="cpu", dtype="float32", adapter_cls=adapter_cls)
        for res in validate_session(session, architecture, where, n, phases=phases, **tiny_options(n)):
            if variant != DEFAULT_VARIANT:
                res.phase = f"{res.phase}[{variant}]"
            results.append(res)
    return results


# -- what a validation exercised ----------------------------------------------------------------

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def exercised(config, layers: Sequence[LayerEntry]) -> dict[str, Any]:
    """What one validated model proved: its cache-layer kinds, features and attention shape.

    ``features`` uses the names of the README support table: ``sliding_window``, ``mla``,
    ``sparse_attention`` (DSA indexer keys), ``kv_sharing`` (layers reusing another's cache), ``moe``,
    ``linear_attention``, ``recurrent_state``, ``linear_and_full_attention``, ``rope:<type>`` (a RoPE scaling other than the
    default) and ``tied_embeddings``.
    """
    cfg = config.get_text_config(decoder=True)
    kinds = sorted({layer.kind for layer in layers})
    features = [kind for kind in (artifact.SLIDING_WINDOW, *artifact.STATE_KINDS) if kind in kinds]
    if artifact.MLA_LATENT in kinds or artifact.MLA_INDEXED in kinds:
        features.append("mla")
    if artifact.MLA_INDEXED in kinds:
        features.append("sparse_attention")
    if any(layer.family_fields.get("shared_by") for layer in layers):
        features.append("kv_sharing")
    if any((getattr(cfg, key, None) or 0) > 1 for key in _EXPERT_KEYS):
        features.append("moe")
    features += [f"rope:{t}" for t in rope_types(cfg) if t != "default"]
    if getattr(config, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False):
        features.append("tied_embeddings")
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if getattr(cfg, "qk_nope_head_dim", None):  # MLA: a query/key head is its plain part + rotary part
        head_dim = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim} if heads else {}
    return {"layer_kinds": kinds, "features": features, "shape": shape}


def rope_types(cfg) -> list[str]:
    """The RoPE types of a config (one per layer type for models that give each its own)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    nested = [v for v in params.values() if isinstance(v, dict)]
    found = [p.get("rope_type") or p.get("type") for p in (nested or [params])]
    return sorted({t for t in found if t})
