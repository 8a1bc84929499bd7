"""verify and diag: continuing from an artifact against a full prefill of the same token ids.

Path A (the reference) prefills context ∥ question in one pass and decodes greedily. Path B loads the
artifact from disk, feeds the question on the restored cache and decodes greedily. Both start from
identical token ids, so they can be compared id by id (verify) and logit by logit (diag).
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
    steps = []
    for i, (a, b) in enumerate(zip(ref_logits, cached_logits)):
        stats = _step_stats(a, b)
        stats["step"] = i
        stats["token"] = ref_ids[i]
        if math.isnan(stats["max_abs_logit_diff"]):
            stats["max_abs_logit_diff"] = float("inf")
        steps.append(stats)
    return steps
