"""verify and diag: continuing from an artifact against a full prefill of the same token ids.

Path A (the reference) prefills context ∥ question in one pass and decodes greedily. Path B loads the
artifact from disk, feeds the question on the restored cache and decodes greedily. Both start from
identical token ids, so they can be compared id by id (verify) and logit by logit (diag).

With several artifacts, path B is their composition (:mod:`kvcdn_core.compose`) and path A the full
prefill of their concatenated token ids: the check a user runs to choose ``--recompute``.
"""

from __future__ import annotations

import dataclasses
import math

from kvcdn_core import artifact, runtime


@dataclasses.dataclass
class VerifyResult:
    n: int
    context_tokens: int
    question_tokens: int
    reference_ids: list[int]
    cached_ids: list[int]
    reference_text: str
    cached_text: str

    @property
    def matches(self) -> int:
        return sum(a == b for a, b in zip(self.reference_ids, self.cached_ids))

    @property
    def first_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.reference_ids, self.cached_ids)):
            if a != b:
                return i
        return None

    @property
    def passed(self) -> bool:
        return self.first_divergence is None and len(self.reference_ids) == len(self.cached_ids)

    def as_dict(self) -> dict:
        return {
            "n": self.n,
            "context_tokens": self.context_tokens,
            "question_tokens": self.question_tokens,
            "matches": self.matches,
            "first_divergence": self.first_divergence,
            "status": "PASS" if self.passed else "MISMATCH",
            "reference_ids": self.reference_ids,
            "cached_ids": self.cached_ids,
            "reference_text": self.reference_text,
            "cached_text": self.cached_text,
        }


def reference(session, context_ids, question_ids, n, forced=None):
    """Path A: a full prefill of context ∥ question, then greedy decoding."""
    cache = session.adapter.new_cache(session.model)
    return runtime.greedy(session, cache, list(context_ids) + list(question_ids), n, forced=forced)


def cached(session, header, question_ids, n, force=False, forced=None):
    """Path B: the artifact loaded from disk, then the question, then greedy decoding."""
    cache, context_ids = runtime.load_cache(session, header, force=force)
    tokens, logits = runtime.greedy(session, cache, question_ids, n, forced=forced)
    return tokens, logits, context_ids


def composed(session, headers, question_ids, n, recompute, rule, force=False, forced=None):
    """Path B of a composition: the artifacts composed, then the question, then greedy decoding."""
    from kvcdn_core import compose

    composition = compose.compose(session, headers, recompute, rule, force=force)
    tokens, logits = runtime.greedy(session, composition.cache, question_ids, n, forced=forced)
    return tokens, logits, composition


def run_verify_composed(session, headers, question: str, n: int, recompute: float, rule: str, force: bool = False):
    """verify on a composition: ``(VerifyResult, Composition)``."""
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    cached_ids, _, composition = composed(session, headers, question_ids, n, recompute, rule, force)
    reference_ids, _ = reference(session, composition.ids, question_ids, n)
    result = VerifyResult(
        n,
        len(composition.ids),
        len(question_ids),
        reference_ids,
        cached_ids,
        runtime.decode(session, reference_ids),
        runtime.decode(session, cached_ids),
    )
    return result, composition


#: The shares ``--recompute auto`` tries, in order: the first whose mean KL is within ``--max-kl`` wins.
AUTO_LADDER = (0.0, 0.05, 0.15, 0.3, 0.5, 1.0)


def run_diag_composed(
    session,
    headers,
    question: str,
    n: int,
    recompute,
    rule: str,
    force: bool = False,
    max_kl: float | None = None,
):
    """diag on a composition: ``(steps, Composition, tried)``, teacher-forced on the full prefill's tokens.

    ``recompute="auto"`` tries :data:`AUTO_LADDER` in order (one reference, the artifacts read once)
    and stops at the first share whose mean KL is within ``max_kl``; ``tried`` lists each share's
    mean KL and argmax agreement.
    """
    from kvcdn_core import compose

    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    parts = compose.load_parts(session, headers, force)
    context_ids = [i for _, ids in parts for i in ids]
    ref_ids, ref_logits = reference(session, context_ids, question_ids, n)
    tried = []
    for share in AUTO_LADDER if recompute == "auto" else (recompute,):
        composition = compose.compose(session, headers, share, rule, force=force, parts=parts)
        _, cached_logits = runtime.greedy(session, composition.cache, question_ids, n, forced=ref_ids)
        steps = _steps(ref_ids, ref_logits, cached_logits)
        figures = summary(steps)
        tried.append({"recompute": share, "mean_kl": figures["mean_kl"], "argmax_agree": figures["argmax_agree"]})
        if max_kl is not None and figures["mean_kl"] <= max_kl:
            break
    return steps, composition, tried


def run_verify(session, header, question: str, n: int, force: bool = False) -> VerifyResult:
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    cached_ids, _, context_ids = cached(session, header, question_ids, n, force=force)
    reference_ids, _ = reference(session, context_ids, question_ids, n)
    return VerifyResult(
        n,
        len(context_ids),
        len(question_ids),
        reference_ids,
        cached_ids,
        runtime.decode(session, reference_ids),
        runtime.decode(session, cached_ids),
    )


def _step_stats(a, b) -> dict:
    import torch

    diff = float((a - b).abs().max())
    pa, pb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    kl = float((pa.exp() * (pa - pb)).sum())
    top_a, top_b = set(a.topk(5).indices.tolist()), set(b.topk(5).indices.tolist())
    return {
        "argmax_agree": int(a.argmax()) == int(b.argmax()),
        "max_abs_logit_diff": diff,
        "kl_divergence": max(kl, 0.0),
        "top5_overlap": len(top_a & top_b) / 5,
    }


def run_diag(session, header, question: str, n: int, force: bool = False) -> list[dict]:
    """Per-step logit comparison; both paths are fed the reference's tokens (teacher forcing)."""
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    context_ids = artifact.read_token_ids(header.path, header)
    ref_ids, ref_logits = reference(session, context_ids, question_ids, n)
    _, cached_logits, _ = cached(session, header, question_ids, n, force=force, forced=ref_ids)
    return _steps(ref_ids, ref_logits, cached_logits)


def _steps(ref_ids, ref_logits, cached_logits) -> list[dict]:
    steps = []
    for i, (a, b) in enumerate(zip(ref_logits, cached_logits)):
        stats = _step_stats(a, b)
        stats["step"] = i
        stats["token"] = ref_ids[i]
        if math.isnan(stats["max_abs_logit_diff"]):
            stats["max_abs_logit_diff"] = float("inf")
        steps.append(stats)
    return steps


def summary(steps: list[dict]) -> dict:
    """The whole run in figures: argmax agreement, first divergence, mean and worst KL, mean top-5 overlap."""
    disagree = [s["step"] for s in steps if not s["argmax_agree"]]
    kls = [s["kl_divergence"] for s in steps]
    return {
        "argmax_agree": len(steps) - len(disagree),
        "first_divergence": disagree[0] if disagree else None,
        "mean_kl": sum(kls) / len(kls),
        "max_kl": max(kls),
        "mean_top5_overlap": sum(s["top5_overlap"] for s in steps) / len(steps),
    }
