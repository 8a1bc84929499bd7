"""Searching a directory: scan its artifacts, tokenize the query as the model's contexts are, and
rank through the directory's prefix index (:mod:`~kvcdn_core.search.prefix`), which gives exactly
:func:`~kvcdn_core.search.rank.rank`'s answer. Apart from :mod:`~kvcdn_core.search.rank` because the
index is built on the ranking."""

from __future__ import annotations

from kvcdn_core import notices
from kvcdn_core.search.index import Warn, scan
from kvcdn_core.search.prefix import open_index
from kvcdn_core.search.rank import (
    SameModel,
    Search,
    infer_model,
    load_adapter,
    query_tokenizer,
    start_token_count,
)


def search(
    directory, query: str, model_ref: str | None = None, revision: str | None = None, warn: Warn = notices.warn
) -> Search:
    """Scan ``directory``, tokenize ``query`` the way the model's contexts are, and rank."""
    from kvcdn_core.model.files import fingerprint as model_fingerprint
    from kvcdn_core.model.files import resolve_model_dir

    entries = scan(directory, warn)
    model_ref = model_ref or infer_model(entries, directory)
    model_dir = resolve_model_dir(model_ref, revision, weights=False)
    fp = model_fingerprint(model_dir, weights=False)
    adapter = load_adapter(model_dir)
    same = SameModel(fp)
    mine = [e for e in entries if same(e.model)]
    check = min(mine, key=lambda e: e.token_count) if mine else None
    tokenizer = query_tokenizer(model_dir, adapter, check)

    def encode(text: str) -> list[int]:
        return list(adapter.encode_context(tokenizer, text))

    ids, start = encode(query), start_token_count(encode)
    index = open_index(directory, entries)
    return Search(
        model_ref, model_dir, fp, adapter, tokenizer, entries, query, ids, start, index.rank(fp, ids, start), index
    )
