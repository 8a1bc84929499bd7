"""Ranking: the query's token ids against each indexed artifact's, by longest common prefix.

Usable prefix: a full-attention cache can be cut to any prefix; a sliding-window layer keeps only
the last window and a linear-attention or recurrent layer a running state of the whole prefix, so
such an artifact is usable only when all of it is a prefix of the query. A continuation also needs
the logits of the query's last token, which no artifact stores, so at least one query token is
always prefilled. Tokenizing the query needs no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import ANY_PREFIX
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.model.files import fingerprint_differences
from kvcdn_core.search.index import Entry

# -- matching and ranking -------------------------------------------------------------------


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    a = np.asarray(a)
    b = np.asarray(b)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def usable_tokens(prefix: int, artifact_tokens: int, query_tokens: int, reuse: str) -> int:
    """Cache tokens a continuation of the query can take from the artifact.

    At least one query token must still be prefilled (its logits start the continuation); a
    whole-prefix artifact counts only when all of it is a prefix of the query.
    """
    cap = max(query_tokens - 1, 0)
    if reuse == ANY_PREFIX:
        return min(prefix, cap)
    return artifact_tokens if prefix == artifact_tokens and artifact_tokens <= cap else 0


@dataclasses.dataclass
class Match:
    entry: Entry
    prefix_tokens: int
    usable_tokens: int

    @property
    def path(self) -> Path:
        return self.entry.path

    @property
    def usable_fraction(self) -> float:
        return self.usable_tokens / self.entry.token_count if self.entry.token_count else 0.0

    def as_dict(self) -> dict[str, Any]:
        e = self.entry
        return {
            "path": str(e.path),
            "prefix_tokens": self.prefix_tokens,
            "artifact_tokens": e.token_count,
            "usable_tokens": self.usable_tokens,
            "usable_fraction": round(self.usable_fraction, 4),
            "reuse": e.reuse,
            "model": e.model.get("id"),
            "compute_dtype": e.compute_dtype,
            "quantization": e.quantization,
        }


@dataclasses.dataclass
class Ranking:
    matches: list[Match]  # best first; only artifacts sharing more than the start tokens
    same_model: int  # artifacts of the query's model that were compared
    foreign: int  # artifacts of another model, skipped by fingerprint

    @property
    def best_usable(self) -> Match | None:
        return self.matches[0] if self.matches and self.matches[0].usable_tokens > 0 else None


def same_model(entry_model: dict, fingerprint: dict) -> bool:
    return not fingerprint_differences(entry_model, fingerprint)


class SameModel:
    """:func:`same_model` against one fingerprint, compared once per model dict: the entries of a
    directory index share theirs."""

    def __init__(self, fingerprint: dict):
        self.fingerprint = fingerprint
        self.seen: dict[int, tuple[dict, bool]] = {}  # id of a model dict -> (the dict, answer)

    def __call__(self, model: dict) -> bool:
        seen = self.seen.get(id(model))
        if seen is None or seen[0] is not model:
            seen = self.seen[id(model)] = (model, same_model(model, self.fingerprint))
        return seen[1]


def rank(
    entries: list[Entry], fingerprint: dict, query_ids: Sequence[int] | np.ndarray, start_tokens: int = 0
) -> Ranking:
    """Match the query against every artifact of the fingerprinted model and sort best first.

    Order: usable tokens, then prefix tokens, then the usable fraction of the artifact (a smaller
    artifact loads faster), unquantized before quantized, then path. Usable comes first so the top
    row is the artifact a continuation would load: with full-attention artifacts it equals the prefix
    (capped one below the query length); an artifact with sliding or recurrent layers whose prefix
    falls short of its end is listed with 0 usable tokens below those that can be reused.
    """
    q = np.asarray(query_ids, dtype=np.int64)
    matches, n_same, n_foreign = [], 0, 0
    same = SameModel(fingerprint)
    for e in entries:
        if not same(e.model):
            n_foreign += 1
            continue
        n_same += 1
        prefix = common_prefix(e.ids, q)
        if prefix <= start_tokens:
            continue
        matches.append(Match(e, prefix, usable_tokens(prefix, e.token_count, len(q), e.reuse)))
    matches.sort(
        key=lambda m: (
            -m.usable_tokens,
            -m.prefix_tokens,
            -m.usable_fraction,
            m.entry.quantization is not None,
            str(m.path),
        )
    )
    return Ranking(matches, n_same, n_foreign)


def start_token_count(encode: Callable[[str], list[int]]) -> int:
    """How many tokens the tokenizer puts before any text (a BOS, a template): common to all queries."""
    return common_prefix(encode("a"), encode("b"))


# -- tokenizing the query without torch -----------------------------------------------------


class QueryTokenizer:
    """The model's ``tokenizer.json`` through the ``tokenizers`` library, called like a transformers
    tokenizer (``tok(text, add_special_tokens=...)["input_ids"]``, ``tok.decode(ids)``).

    ``transformers.AutoTokenizer`` imports torch (about 2 s); this loads in milliseconds. The rule
    for start and end tokens is transformers 5's: with a ``tokenizer.json``, its post-processor
    decides them and ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json`` are ignored.
    Without a post-processor transformers applies defaults of the tokenizer class, which only
    transformers knows, so that case is refused here (and :func:`query_tokenizer` falls back).
    :func:`query_tokenizer` also checks the result against a saved context.
    """

    kind = "tokenizers"

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        if self._tok.post_processor is None:
            raise ValueError("tokenizer.json has no post-processor; its start tokens depend on the class")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_adapter(model_dir: Path):
    """The installed adapter for the model's architecture, or the base one (tokenizing is generic)."""
    from kvcdn_core.contracts.adapter import ModelAdapter
    from kvcdn_core.model.files import architecture_of, read_config
    from kvcdn_core.plugin_host.registry import adapter_for

    try:
        return adapter_for(architecture_of(read_config(model_dir)))()
    except KvcdnError:
        return ModelAdapter()


def transformers_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    from kvcdn_core.contracts.adapter import quiet_transformers

    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.kind = "transformers"
    return tok


def query_tokenizer(model_dir: Path, adapter, check: Entry | None = None):
    """A tokenizer for search queries: :class:`QueryTokenizer` when it reproduces ``check``'s saved
    token ids from its saved context (or there is nothing to check), else transformers' own.
    """
    if (model_dir / "tokenizer.json").is_file():
        try:
            tok = QueryTokenizer(model_dir)
        except Exception:  # an exotic tokenizer.json the plain library cannot build
            tok = None
        if tok is not None and _reproduces(tok, adapter, check):
            return tok
    return transformers_tokenizer(model_dir)


def _reproduces(tok, adapter, entry: Entry | None) -> bool:
    if entry is None:
        return True
    try:
        context = artifact.read_manifest(entry.path).get("context")
    except (ArtifactError, OSError):
        return True
    if not isinstance(context, str) or not context:
        return True
    try:
        ids = adapter.encode_context(tok, context)
    except Exception:  # an adapter that needs a full transformers tokenizer
        return False
    return ids == entry.ids.tolist()


# -- a search, end to end ------------------------------------------------------------------


@dataclasses.dataclass
class Search:
    """A query tokenized for a model and ranked against the artifacts under a directory."""

    model_ref: str
    model_dir: Path
    fingerprint: dict
    adapter: Any
    tokenizer: Any
    entries: list[Entry]
    query: str
    query_ids: list[int]
    start_tokens: int
    ranking: Ranking
    index: Any = None  # the directory's prefix index (search.prefix.PrefixIndex), when searched through one

    def retokenized(self, tokenizer, fingerprint: dict | None = None) -> Search:
        """The same search with another tokenizer (a loaded model's): reranked only if ids differ."""
        ids = list(self.adapter.encode_context(tokenizer, self.query))
        fingerprint = fingerprint or self.fingerprint
        if ids == self.query_ids and fingerprint == self.fingerprint:
            return dataclasses.replace(self, tokenizer=tokenizer)
        start = start_token_count(lambda t: self.adapter.encode_context(tokenizer, t))
        return dataclasses.replace(
            self,
            tokenizer=tokenizer,
            fingerprint=fingerprint,
            query_ids=ids,
            start_tokens=start,
            ranking=self.index.rank(fingerprint, ids, start)
            if self.index is not None
            else rank(self.entries, fingerprint, ids, start),
        )


def infer_model(entries: list[Entry], directory) -> str:
    """The one model the artifacts under a directory were made with, when there is exactly one."""
    ids = sorted({str(e.model["id"]) for e in entries if e.model.get("id")})
    if len(ids) == 1:
        return ids[0]
    if not ids:
        raise KvcdnError(f"no readable artifact under '{directory}' names its model; pass --model")
    raise KvcdnError(f"artifacts under '{directory}' come from {len(ids)} models; pass --model to choose one")
