"""Search a chunk store (``--store URI``): the query is looked up in the store's prefix index.

A lookup reads only the index (:mod:`kvcdn_core.store.index`), never an artifact: its cost follows
the query's chunk count, not the store's size. A backend that declares ``prefix_lookup`` (the
hosted endpoint) keeps its own index and is asked instead, by chain keys; its hits are the same. Continuing fetches the one best artifact through
the chunk store (every chunk checked against its digest) into a temporary directory and continues
from it exactly as ``--dir`` does: the prefix is recomputed from the fetched file's own token ids.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from kvcdn_core import notices
from kvcdn_core.errors import KvcdnError
from kvcdn_core.search.index import Warn, _entry_from_file
from kvcdn_core.search.rank import (
    Search,
    load_adapter,
    query_tokenizer,
    rank,
    same_model,
    start_token_count,
)


@dataclasses.dataclass
class StoreSearch:
    """A query tokenized for a model and looked up in a chunk store's index."""

    uri: str
    backend: Any
    model_ref: str
    model_dir: Path
    fingerprint: dict
    adapter: Any
    tokenizer: Any
    query: str
    query_ids: list[int]
    start_tokens: int
    hits: list  # store.index.Hit, best first
    roots: int  # roots (model, dtype, quantization) of this model in the index
    foreign: int  # roots of other models

    def as_dict(self, limit: int) -> dict[str, Any]:
        return {
            "store": self.uri,
            "model": self.model_ref,
            "query_tokens": len(self.query_ids),
            "start_tokens": self.start_tokens,
            "tokenizer": getattr(self.tokenizer, "kind", "transformers"),
            "roots_searched": self.roots,
            "skipped_other_models": self.foreign,
            "matches": [
                {
                    "name": h.name,
                    "prefix_tokens": h.prefix_tokens,
                    "artifact_tokens": h.token_count,
                    "usable_tokens": h.usable_tokens,
                    "usable_fraction": round(h.usable_tokens / h.token_count, 4) if h.token_count else 0.0,
                    "reuse": h.reuse,
                    "compute_dtype": h.compute_dtype,
                    "quantization": h.quantization,
                }
                for h in self.hits[:limit]
            ],
        }


def search_store(
    uri: str,
    query: str,
    model_ref: str | None = None,
    revision: str | None = None,
    limit: int = 10,
) -> StoreSearch:
    """Open the store, tokenize ``query`` as a context of the model, and look it up under every root
    (compute dtype, quantization) the index holds for that model."""
    from kvcdn_core.model.files import fingerprint as model_fingerprint
    from kvcdn_core.model.files import resolve_model_dir
    from kvcdn_core.plugin_host.registry import open_storage
    from kvcdn_core.store import index

    backend = open_storage(uri)
    remote = type(backend).offers("prefix_lookup")  # the hosted endpoint: its own index, by chain keys
    roots = backend.prefix_roots() if remote else index.roots(backend)
    if model_ref is None:
        model_ref = _one_model(roots, uri)
    model_dir = resolve_model_dir(model_ref, revision, weights=False)
    fp = model_fingerprint(model_dir, weights=False)
    adapter = load_adapter(model_dir)
    tokenizer = query_tokenizer(model_dir, adapter)

    def encode(text: str) -> list[int]:
        return list(adapter.encode_context(tokenizer, text))

    ids, start = encode(query), start_token_count(encode)
    mine = [r for r in roots if same_model(r.get("model") or {}, fp)]
    hits = []
    for r in mine:
        if remote:
            hits += backend.prefix_lookup(r["root"], ids, start, limit)
        else:
            hits += index.lookup(backend, r["root"], ids, start, limit, refresh=False)
    hits.sort(key=index.Hit.sort_key)
    return StoreSearch(
        uri,
        backend,
        model_ref,
        model_dir,
        fp,
        adapter,
        tokenizer,
        query,
        ids,
        start,
        hits,
        len(mine),
        len(roots) - len(mine),
    )


def _one_model(roots: list[dict], uri: str) -> str:
    """The one model the store's artifacts were made with, when there is exactly one."""
    ids = sorted({str(r["model"]["id"]) for r in roots if (r.get("model") or {}).get("id")})
    if len(ids) == 1:
        return ids[0]
    if not ids:
        raise KvcdnError(f"the index of '{uri}' names no model (is it a chunk store?); pass --model")
    raise KvcdnError(f"artifacts in '{uri}' come from {len(ids)} models; pass --model to choose one")


def fetch_best(found: StoreSearch, directory: Path, warn: Warn = notices.warn) -> Search:
    """Fetch the best usable artifact into ``directory`` and return a directory search over it.

    One that cannot be fetched (a chunk missing or damaged) is skipped with a warning for the next.
    Without a usable hit the search holds no artifact: the prompt is prefilled from scratch.
    """
    from kvcdn_core.store.chunkstore import ChunkStore

    remote = type(found.backend).offers("prefix_lookup")
    entries = []
    for hit in [h for h in found.hits if h.usable_tokens > 0]:
        target = Path(directory) / f"{hit.name}.kv"
        try:
            if remote:
                target.parent.mkdir(parents=True, exist_ok=True)
                found.backend.fetch_hit(hit, target)
            else:
                ChunkStore(found.backend).get(hit.name, target)
            entries.append(_entry_from_file(target, os.stat(target)))
            break
        except (KvcdnError, OSError) as exc:
            warn(f"skipping '{hit.name}' in {found.uri}: {exc}")
    return Search(
        found.model_ref,
        found.model_dir,
        found.fingerprint,
        found.adapter,
        found.tokenizer,
        entries,
        found.query,
        found.query_ids,
        found.start_tokens,
        rank(entries, found.fingerprint, found.query_ids, found.start_tokens),
    )
