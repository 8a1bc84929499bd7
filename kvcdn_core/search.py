"""Prefix search over saved artifacts, and continuing a prompt from the best one.

Searching reads only artifact headers and token ids (pure Python plus numpy, never torch), keeps
them in one index file per directory so a later search reads one file per directory instead of
every artifact, and compares the query's token ids with each artifact's by longest common prefix.

Reusing (``continue --dir``, ``search --tree``) loads the best artifact, crops it to the usable
prefix through the model adapter, and prefills only the rest of the prompt, so the result is the
same token ids a full prefill of the prompt would see. Those functions import torch lazily.

Usable prefix: a full-attention cache can be cut to any prefix; a sliding-window layer keeps only
the last window and a linear-attention or recurrent layer a running state of the whole prefix, so
such an artifact is usable only when all of it is a prefix of the query. A continuation also needs the logits of the query's last token,
which no artifact stores, so at least one query token is always prefilled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvcdn_core import artifact as fmt
from kvcdn_core.atomic import atomic_open
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.model_files import COMPATIBILITY_KEYS, fingerprint_differences

INDEX_NAME = ".kvcdn-index"
INDEX_MAGIC = b"KVCDNIX1"
INDEX_VERSION = 1
ANY_PREFIX = "any_prefix"
WHOLE_PREFIX = "whole_prefix"
FINGERPRINT_KEYS = COMPATIBILITY_KEYS

Warn = Callable[[str], None]


def _stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# -- the catalog: artifacts found under a directory -------------------------------------------


@dataclasses.dataclass
class Entry:
    """What search needs of one artifact: where it is, its model, its reuse rule and its token ids."""

    path: Path
    size: int
    mtime_ns: int
    ino: int
    model: dict[str, Any]
    token_count: int
    reuse: str
    compute_dtype: str
    quantization: str | None
    ids: np.ndarray  # int32, length token_count

    def record(self) -> dict[str, Any]:
        return {"name": self.path.name, "size": self.size, "mtime_ns": self.mtime_ns, "ino": self.ino,
                "model": self.model, "token_count": self.token_count, "reuse": self.reuse,
                "compute_dtype": self.compute_dtype, "quantization": self.quantization}


def reuse_of(manifest: dict[str, Any]) -> str:
    """The stricter of the manifest's ``reuse`` field and what its layer kinds allow."""
    computed = fmt.reuse_mode(manifest)
    return WHOLE_PREFIX if WHOLE_PREFIX in (computed, manifest.get("reuse")) else ANY_PREFIX


def _entry_from_file(path: Path, st: os.stat_result) -> Entry:
    header = fmt.read_header(path)
    ids = fmt.read_token_ids(path, header)
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ArtifactError(f"{path}: corrupted: token ids out of range")
    m = header.manifest
    model = m.get("model") or {}
    quant = m.get("quantization")
    return Entry(
        path, st.st_size, st.st_mtime_ns, st.st_ino,
        {k: model.get(k) for k in ("id", *FINGERPRINT_KEYS)},
        header.token_count, reuse_of(m), str(m.get("compute_dtype")),
        quant.get("scheme") if isinstance(quant, dict) else None,
        array.astype(np.int32),
    )


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/kvcdn`` or ``~/.cache/kvcdn``: where indexes of read-only directories go."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kvcdn"


def index_path(directory: Path) -> Path:
    """The directory's own ``.kvcdn-index``, or a per-user cache file when the directory is read-only."""
    if os.access(directory, os.W_OK | os.X_OK):
        return directory / INDEX_NAME
    key = hashlib.sha256(os.fsencode(directory.resolve())).hexdigest()[:32]
    return cache_home() / "search-index" / key


def _read_index(path: Path, directory: Path) -> dict[str, Entry]:
    """Entries of an index file, by file name; empty when missing, foreign-owned or malformed."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            # An index written by another user could point search at the wrong artifacts.
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                return {}
            data = fh.read()
    except OSError:
        return {}
    try:
        if data[:8] != INDEX_MAGIC:
            return {}
        (json_len,) = struct.unpack_from("<Q", data, 8)
        meta = json.loads(data[16:16 + json_len])
        if meta.get("version") != INDEX_VERSION:
            return {}
        start = 16 + json_len
        start += (-start) % 4
        ids = np.frombuffer(data, dtype="<i4", offset=start)
        entries = {}
        for rec in meta["entries"]:
            name, offset, count = rec["name"], int(rec["offset"]), int(rec["token_count"])
            if "/" in name or os.sep in name or name in (".", "..") or offset < 0 or offset + count > ids.size:
                return {}
            entries[name] = Entry(
                directory / name, int(rec["size"]), int(rec["mtime_ns"]), int(rec["ino"]), dict(rec["model"]),
                count, str(rec["reuse"]), str(rec["compute_dtype"]), rec.get("quantization"),
                ids[offset:offset + count],
            )
        return entries
    except (ValueError, KeyError, TypeError, struct.error):
        return {}


def _write_index(path: Path, entries: list[Entry]) -> None:
    """Write an index atomically (temporary file, fsync, rename); a failure only costs speed."""
    records, offset = [], 0
    for e in entries:
        records.append({**e.record(), "offset": offset})
        offset += e.token_count
    blob = json.dumps({"version": INDEX_VERSION, "entries": records}, separators=(",", ":")).encode()
    head = INDEX_MAGIC + struct.pack("<Q", len(blob)) + blob
    head += b"\0" * ((-len(head)) % 4)
    try:
        with atomic_open(path, mode=0o600) as fh:
            fh.write(head)
            for e in entries:
                fh.write(np.ascontiguousarray(e.ids, dtype="<i4").tobytes())
    except OSError:
        pass


def _index_directory(directory: Path, names: list[str], warn: Warn) -> list[Entry]:
    where = index_path(directory)
    known = _read_index(where, directory)
    entries, changed = [], False
    for name in names:
        path = directory / name
        try:
            st = os.stat(path)
        except OSError as exc:
            warn(f"skipping {path}: cannot read: {exc.strerror or exc}")
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        old = known.get(name)
        if old and (old.size, old.mtime_ns, old.ino) == (st.st_size, st.st_mtime_ns, st.st_ino):
            entries.append(old)
            continue
        changed = True
        try:
            entries.append(_entry_from_file(path, st))
        except ArtifactError as exc:
            warn(f"skipping {exc}")
        except OSError as exc:
            warn(f"skipping {path}: cannot read: {exc.strerror or exc}")
    if changed or {e.path.name for e in entries} != set(known):
        _write_index(where, entries)
    return entries


def scan(root: str | os.PathLike, warn: Warn = _stderr_warning) -> list[Entry]:
    """Every readable `.kv` artifact under ``root`` (recursively), through the per-directory indexes.

    Unreadable or invalid files are skipped with one warning each; they are not cached, so they are
    tried again (and warned about again) next time.
    """
    root = Path(root)
    if not root.is_dir():
        raise KvcdnError(f"directory '{root}' does not exist" if not root.exists() else f"'{root}' is not a directory")

    def on_error(exc: OSError) -> None:
        warn(f"skipping {exc.filename}: cannot read: {exc.strerror or exc}")

    entries = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=on_error):
        dirnames.sort()
        names = sorted(f for f in filenames if f.endswith(".kv"))
        if names:
            entries.extend(_index_directory(Path(dirpath), names, warn))
    return entries


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
        return {"path": str(e.path), "prefix_tokens": self.prefix_tokens, "artifact_tokens": e.token_count,
                "usable_tokens": self.usable_tokens, "usable_fraction": round(self.usable_fraction, 4),
                "reuse": e.reuse, "model": e.model.get("id"), "compute_dtype": e.compute_dtype,
                "quantization": e.quantization}


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


def rank(entries: list[Entry], fingerprint: dict, query_ids: list[int], start_tokens: int = 0) -> Ranking:
    """Match the query against every artifact of the fingerprinted model and sort best first.

    Order: usable tokens, then prefix tokens, then the usable fraction of the artifact (a smaller
    artifact loads faster), unquantized before quantized, then path. Usable comes first so the top
    row is the artifact a continuation would load: with full-attention artifacts it equals the prefix
    (capped one below the query length); an artifact with sliding or recurrent layers whose prefix
    falls short of its end is listed with 0 usable tokens below those that can be reused.
    """
    q = np.asarray(query_ids, dtype=np.int64)
    matches, n_same, n_foreign = [], 0, 0
    for e in entries:
        if not same_model(e.model, fingerprint):
            n_foreign += 1
            continue
        n_same += 1
        prefix = common_prefix(e.ids, q)
        if prefix <= start_tokens:
            continue
        matches.append(Match(e, prefix, usable_tokens(prefix, e.token_count, len(q), e.reuse)))
    matches.sort(key=lambda m: (-m.usable_tokens, -m.prefix_tokens, -m.usable_fraction,
                                m.entry.quantization is not None, str(m.path)))
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
    from kvcdn_core.model_files import architecture_of, read_config
    from kvcdn_core.registry import adapter_for

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
        context = fmt.read_manifest(entry.path).get("context")
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

    def retokenized(self, tokenizer, fingerprint: dict | None = None) -> "Search":
        """The same search with another tokenizer (a loaded model's): reranked only if ids differ."""
        ids = list(self.adapter.encode_context(tokenizer, self.query))
        fingerprint = fingerprint or self.fingerprint
        if ids == self.query_ids and fingerprint == self.fingerprint:
            return dataclasses.replace(self, tokenizer=tokenizer)
        start = start_token_count(lambda t: self.adapter.encode_context(tokenizer, t))
        return dataclasses.replace(self, tokenizer=tokenizer, fingerprint=fingerprint, query_ids=ids,
                                   start_tokens=start, ranking=rank(self.entries, fingerprint, ids, start))


def infer_model(entries: list[Entry], directory) -> str:
    """The one model the artifacts under a directory were made with, when there is exactly one."""
    ids = sorted({str(e.model["id"]) for e in entries if e.model.get("id")})
    if len(ids) == 1:
        return ids[0]
    if not ids:
        raise KvcdnError(f"no readable artifact under '{directory}' names its model; pass --model")
    raise KvcdnError(f"artifacts under '{directory}' come from {len(ids)} models; pass --model to choose one")


def search(directory, query: str, model_ref: str | None = None, revision: str | None = None,
           warn: Warn = _stderr_warning) -> Search:
    """Scan ``directory``, tokenize ``query`` the way the model's contexts are, and rank."""
    from kvcdn_core.model_files import fingerprint as model_fingerprint
    from kvcdn_core.model_files import resolve_model_dir

    entries = scan(directory, warn)
    model_ref = model_ref or infer_model(entries, directory)
    model_dir = resolve_model_dir(model_ref, revision, weights=False)
    fp = model_fingerprint(model_dir, weights=False)
    adapter = load_adapter(model_dir)
    mine = [e for e in entries if same_model(e.model, fp)]
    check = min(mine, key=lambda e: e.token_count) if mine else None
    tokenizer = query_tokenizer(model_dir, adapter, check)

    def encode(text: str) -> list[int]:
        return list(adapter.encode_context(tokenizer, text))

    ids, start = encode(query), start_token_count(encode)
    return Search(model_ref, model_dir, fp, adapter, tokenizer, entries, query, ids, start,
                  rank(entries, fp, ids, start))


# -- reusing the best artifact (torch from here on, imported lazily) ------------------------


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

    def as_dict(self) -> dict[str, Any]:
        return {"artifact": str(self.path) if self.path else None, "query_tokens": self.query_tokens,
                "reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens,
                "from_scratch": self.path is None}


def prefill_reusing(session, ranking: Ranking, query_ids: list[int], chunk: int | None = None,
                    progress: bool = False, force: bool = False) -> Prefilled:
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
            header = fmt.read_header(match.path)
            cache, ids = runtime.load_cache(session, header, force=force)
        except ArtifactError as exc:
            print(f"warning: skipping {match.path}: {str(exc).removeprefix(str(match.path) + ': ')}",
                  file=sys.stderr)
            continue
        usable = usable_tokens(common_prefix(ids, query_ids), len(ids), len(query_ids), reuse_of(header.manifest))
        if usable > 0:
            if usable < len(ids):
                cache = session.adapter.crop(cache, header.manifest["layers"], usable, token_count=len(ids))
            cache, logits = runtime.prefill(session, list(query_ids[usable:]), chunk=chunk, progress=progress,
                                            cache=cache)
            return Prefilled(cache, logits, len(query_ids), usable, match.path)
    cache, logits = runtime.prefill(session, list(query_ids), chunk=chunk, progress=progress)
    return Prefilled(cache, logits, len(query_ids), 0, None)


def greedy_from(session, cache, logits, n: int) -> list[int]:
    """Decode ``n`` tokens greedily, starting from the logits of the last prefilled token."""
    from kvcdn_core import runtime

    return runtime.decode_from(session, cache, logits, n)[0]


def share_across_batch(cache, n: int) -> None:
    """Turn a one-sequence cache into ``n`` rows that all start from it.

    Plain and sliding-window transformers layers get a broadcast view (``expand``: no copy). They
    grow by concatenation, which materialises each row at the first branch step (as it copies the
    whole cache at every step even for one sequence). Other layers (linear-attention and recurrent
    states, which are updated in place and so cannot share a view) are copied per row through
    ``reorder_cache``, the call beam search uses, so every transformers layer type supports it.
    """
    import torch
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    rows = torch.zeros(n, dtype=torch.long)
    layers = getattr(cache, "layers", None)
    if layers is None:
        if not hasattr(cache, "reorder_cache"):
            raise KvcdnError(f"a {type(cache).__name__} cannot be split into branches; --tree needs that")
        cache.reorder_cache(rows)
        return
    for layer in layers:
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
            if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.expand(n, *layer.keys.shape[1:])
                layer.values = layer.values.expand(n, *layer.values.shape[1:])
        elif hasattr(layer, "reorder_cache"):
            layer.reorder_cache(rows)
        else:
            raise KvcdnError(f"a {type(layer).__name__} cache layer cannot be split into branches; --tree needs that")


@dataclasses.dataclass
class Candidate:
    first_token_logprob: float
    token_ids: list[int]
    text: str

    def as_dict(self) -> dict[str, Any]:
        return {"first_token": self.token_ids[0], "first_token_logprob": self.first_token_logprob,
                "token_ids": self.token_ids, "text": self.text}


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
    share_across_batch(cache, n)
    feed = torch.tensor(firsts, dtype=torch.long, device=session.device).view(n, 1)
    with torch.inference_mode():
        for _ in range(tokens - 1):
            out, cache = session.adapter.forward(session.model, feed, cache)
            nxt = out[:, -1].float().argmax(dim=-1)
            for seq, t in zip(seqs, nxt.tolist()):
                seq.append(t)
            feed = nxt.view(n, 1)
    return [Candidate(float(lp), seq, runtime.decode(session, seq)) for lp, seq in zip(top.values.tolist(), seqs)]
