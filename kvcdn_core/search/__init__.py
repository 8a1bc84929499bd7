"""Prefix search over saved artifacts, and continuing a prompt from the best one.

Three steps, one module each: :mod:`~kvcdn_core.search.index` finds and indexes artifacts (headers
and token ids, never torch), :mod:`~kvcdn_core.search.rank` ranks them by the token prefix they
share with a query, :mod:`~kvcdn_core.search.reuse` loads the best one and prefills the rest.
"""

from kvcdn_core.artifact.manifest import ANY_PREFIX, WHOLE_PREFIX
from kvcdn_core.search.directory import search
from kvcdn_core.search.index import INDEX_NAME, Entry, index_path, scan
from kvcdn_core.search.rank import (
    Match,
    QueryTokenizer,
    Ranking,
    Search,
    common_prefix,
    infer_model,
    load_adapter,
    query_tokenizer,
    rank,
    same_model,
    start_token_count,
    usable_tokens,
)
from kvcdn_core.search.reuse import Candidate, Prefilled, prefill_reusing, session_for_search, tree

__all__ = [
    "ANY_PREFIX",
    "INDEX_NAME",
    "WHOLE_PREFIX",
    "Candidate",
    "Entry",
    "Match",
    "Prefilled",
    "QueryTokenizer",
    "Ranking",
    "Search",
    "common_prefix",
    "index_path",
    "infer_model",
    "load_adapter",
    "prefill_reusing",
    "query_tokenizer",
    "rank",
    "same_model",
    "scan",
    "search",
    "session_for_search",
    "start_token_count",
    "tree",
    "usable_tokens",
]
