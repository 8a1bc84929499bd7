"""The quantized validation phase: a scheme checked on a family's real cache by ``kvcdn validate``.

Kept apart from :mod:`kvcdn_core.quant.codec` because it runs the model (:mod:`kvcdn_core.exactness.against_prefill`), which
loads artifacts through :mod:`kvcdn_core.runtime`, which dequantizes through :mod:`kvcdn_core.quant.codec`.
"""

from __future__ import annotations

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import Manifest, manifest_of
from kvcdn_core.contracts.quantizer import Quantizer
from kvcdn_core.plugin_host.registry import quantizer_for
from kvcdn_core.quant.codec import dequantize_tensors, quantize_cache

#: A reference step is a near-tie when its top-2 logit margin is below this fraction of its logit
#: range: any lossy cache may flip such a step, so the validation phase does not count it.
NEAR_TIE_FRACTION = 0.05


def compare_steps(reference_logits, quant_logits, near_tie: float = NEAR_TIE_FRACTION) -> dict:
    """Teacher-forced comparison: argmax agreement per step, and which disagreements are near-ties."""
    disagree, decisive, worst = [], [], 0.0
    for i, (a, b) in enumerate(zip(reference_logits, quant_logits)):
        worst = max(worst, float((a - b).abs().max()))
        if int(a.argmax()) == int(b.argmax()):
            continue
        top = a.topk(2).values
        margin = float(top[0] - top[1])
        disagree.append(i)
        if margin >= near_tie * float(a.max() - a.min()):
            decisive.append(i)
    return {"steps": len(reference_logits), "disagree": disagree, "decisive": decisive, "max_abs_logit_diff": worst}


#: The validation phase fails below this teacher-forced argmax agreement (a broken cache agrees on
#: almost no step; int8 on the tiny random models agrees on 14-16 of 16).
MIN_AGREEMENT = 0.75


def bound_violations(manifest: Manifest, original: dict, quantizer: Quantizer, dequantized: dict) -> list[str]:
    """Names of quantized tensors whose dequantized values leave the scheme's stated error bound."""
    bad = []
    for rec in (manifest.quantization or {})["layers"]:
        for trec in (rec.get("tensors") or {}).values():
            if trec.get("action") != "quantized":
                continue
            x = original[trec["name"]]
            err = (x.float() - dequantized[trec["name"]].float()).abs()
            if bool((err > quantizer.error_bound(trec["role"], x)).any()):
                bad.append(trec["name"])
    return bad


def validation_phase(scheme: str = "int8"):
    """A :mod:`kvcdn_core.exactness.architecture` phase for ``scheme`` on a family's real cache.

    Quantize the run's artifact, check every dequantized tensor against the scheme's error bound,
    load it from disk and continue. Free-running token matches are reported; the pass criterion is a
    teacher-forced argmax agreement of at least :data:`MIN_AGREEMENT`, with flips at near-ties
    counted apart. Random-weight tiny models decode through near-ties (top-2 margins of 0.002 logits
    where int8 moves logits by about 0.05) and MoE routing decisions that any lossy cache can flip,
    so strict token equality there measures the model, not the scheme; docs/quantization.md shows
    int8 token-exact on trained models.
    """

    def phase(run):
        from kvcdn_core.exactness.against_prefill import cached, reference

        name = f"quant:{scheme}"
        if run.header is None or run.reference_ids is None:
            return run.result(name, False, "skipped: an earlier phase failed")
        quantizer = quantizer_for(scheme)()
        original = artifact.load_tensors(run.header)
        result = quantize_cache(manifest_of(run.header), original, quantizer)
        path = run.workdir / f"{run.architecture}.{quantizer.default_output_suffix()}.kv"
        artifact.write_artifact(path, result.manifest, result.tensors)
        header = artifact.read_header(path)
        outside = bound_violations(manifest_of(header), original, quantizer, dequantize_tensors(header))
        ids, _, _ = cached(run.session, header, run.question_ids, run.n)
        _, ref_logits = reference(run.session, run.context_ids, run.question_ids, run.n)
        _, q_logits, _ = cached(run.session, header, run.question_ids, run.n, forced=run.reference_ids)
        cmp = compare_steps(ref_logits, q_logits)
        pairs = list(zip(run.reference_ids, ids))
        matches = sum(a == b for a, b in pairs)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        kept = f", {result.kept_layers} kept in full precision" if result.kept_layers else ""
        agree = cmp["steps"] - len(cmp["disagree"])
        ties = len(cmp["disagree"]) - len(cmp["decisive"])
        detail = (
            f"token match {matches}/{run.n}; teacher-forced argmax {agree}/{cmp['steps']}"
            + (f" ({ties} flips at near-ties)" if ties else "")
            + f", max |dlogit| {cmp['max_abs_logit_diff']:.3g}; {result.quantized_layers} layers quantized{kept}"
        )
        if cmp["decisive"]:
            detail += f"; clear steps flipped: {cmp['decisive']}"
        if outside:
            detail += f"; outside the error bound: {', '.join(outside[:3])}"
        ok = not outside and len(ids) == run.n and agree >= MIN_AGREEMENT * cmp["steps"]
        return run.result(name, ok, detail, first)

    phase.__name__ = f"phase_quant_{scheme.replace('-', '_')}"
    return phase
