"""Reuse: continue a prompt from the best artifact (``continue --dir``, ``search --tree``).

Loads the best artifact, has the model adapter crop it to the usable prefix, and prefills only the
rest of the prompt, so the result is the same token ids a full prefill of the prompt would see.
Imports torch lazily.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvcdn_core import artifact, notices
from kvcdn_core.artifact.manifest import manifest_of
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.search.index import Warn
from kvcdn_core.search.rank import Ranking, Search, common_prefix, usable_tokens


def session_for_search(found: Search, revision: str | None = None, device: str = "auto", dtype: str = "auto"):
    """The model of a search, in the best artifact's compute dtype unless ``dtype`` says otherwise,
    and the search retokenized with that model's tokenizer."""
    from kvcdn_core import runtime

    best = found.ranking.best_usable
    manifest = manifest_of(artifact.read_header(best.path)) if best is not None else None
    session = runtime.session_for_artifact(manifest, found.model_ref, revision, device, dtype)
    return session, found.retokenized(session.tokenizer, session.fingerprint)


@dataclasses.dataclass
class Prefilled:
    """A cache holding the whole query and the logits of its last token."""

    cache: Any
    logits: Any
    query_tokens: int
    reused_tokens: int
    path: Path | None

    @property
    def prefilled_tokens(self) -> int:
        return self.query_tokens - self.reused_tokens

    def summary(self, what: str = "query") -> str:
        """One line saying what was reused and what was prefilled."""
        if self.path is None:
            return (
                f"no saved artifact has a usable prefix of the {what}; "
                f"prefilled all {self.query_tokens} tokens from scratch"
            )
        return (
            f"reused {self.reused_tokens} of {self.query_tokens} {what} tokens from {self.path}; "
            f"prefilled {self.prefilled_tokens}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "artifact": str(self.path) if self.path else None,
            "query_tokens": self.query_tokens,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "from_scratch": self.path is None,
        }


def prefill_reusing(
    session,
    ranking: Ranking,
    query_ids: list[int],
    chunk: int | None = None,
    progress: bool = False,
    force: bool = False,
    warn: Warn = notices.warn,
) -> Prefilled:
    """Load the best usable artifact, crop it to the usable prefix and prefill the rest of the query.

    The artifact's own token ids (not the index) decide the prefix, so a file changed since the scan
    cannot feed wrong tokens. Without a usable artifact the whole query is prefilled.
    """
    from kvcdn_core import runtime

    chunk = chunk or runtime.DEFAULT_CHUNK
    if not query_ids:
        raise KvcdnError("the prompt has no tokens")
    for match in [m for m in ranking.matches if m.usable_tokens > 0]:
        try:  # a damaged or foreign-weights artifact is skipped for the next best, not fatal
            header = artifact.read_header(match.path)
            cache, ids = runtime.load_cache(session, header, force=force)
        except ArtifactError as exc:
            warn(f"skipping {match.path}: {str(exc).removeprefix(str(match.path) + ': ')}")
            continue
        usable = usable_tokens(common_prefix(ids, query_ids), len(ids), len(query_ids), manifest_of(header).reuse)
        if usable > 0:
            if usable < len(ids):
                cache = session.adapter.crop(cache, manifest_of(header).layers, usable, token_count=len(ids))
            cache, logits = runtime.prefill(
                session, list(query_ids[usable:]), chunk=chunk, progress=progress, cache=cache
            )
            return Prefilled(cache, logits, len(query_ids), usable, match.path)
    cache, logits = runtime.prefill(session, list(query_ids), chunk=chunk, progress=progress)
    return Prefilled(cache, logits, len(query_ids), 0, None)


@dataclasses.dataclass
class Candidate:
    first_token_logprob: float
    token_ids: list[int]
    text: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "first_token": self.token_ids[0],
            "first_token_logprob": self.first_token_logprob,
            "token_ids": self.token_ids,
            "text": self.text,
        }


def tree(session, prefilled: Prefilled, n: int, tokens: int) -> list[Candidate]:
    """``n`` distinct continuations: one per most likely next token, each continued greedily.

    The shared prefix is in ``prefilled.cache`` once; the branches decode together as one batch.
    """
    import torch

    from kvcdn_core import runtime

    logprobs = torch.log_softmax(prefilled.logits.double(), dim=-1)
    if n > logprobs.numel():
        raise KvcdnError(f"--tree {n} asks for more branches than the vocabulary has tokens ({logprobs.numel()})")
    top = torch.topk(logprobs, n)
    firsts = top.indices.tolist()
    seqs = [[t] for t in firsts]
    cache = prefilled.cache
    session.adapter.share_across_batch(cache, n)
    feed = torch.tensor(firsts, dtype=torch.long, device=session.device).view(n, 1)
    with torch.inference_mode():
        for _ in range(tokens - 1):
            out, cache = session.adapter.forward(session.model, feed, cache)
            nxt = out[:, -1].float().argmax(dim=-1)
            for seq, t in zip(seqs, nxt.tolist()):
                seq.append(t)
            feed = nxt.view(n, 1)
    return [Candidate(float(lp), seq, runtime.decode(session, seq)) for lp, seq in zip(top.values.tolist(), seqs)]
