"""Benchmark `kvcdn search` over many synthetic artifacts (default: 1,000 of 4,000 tokens each).

Search reads headers and token ids only, so the artifacts carry real token ids (the tiny tokenizer's
encoding of generated text) around one-element cache tensors: cheap to write, identical to search.
They are grouped like real use: documents, and variants of each that share a prefix of the
document of every length, spread over several subdirectories (one index file each).

Timed: the first scan (every header read, indexes written), a warm in-process search (indexes
read, tokenizer loaded, query tokenized and ranked), and the whole `kvcdn search` command in a
fresh process (Python start-up and plugin discovery included), each the median of --reps runs.

    OMP_NUM_THREADS=1 python benchmarks/search_bench.py [--artifacts 1000] [--tokens 4000] [--reps 5]

With ``--store-index 1000,10000,100000`` it measures the chunk store's prefix index instead
(:mod:`kvcdn_core.store.index`): the same corpus shape (documents, and variants sharing a prefix of
every length), token ids drawn at random from a 151,936-token vocabulary, the index built directly
from them into one base object in a local store (a lookup reads only the index, so no ``.kv`` file
is written: 100,000 real files take hours here), then the p50 and p99 of in-process lookups.

    OMP_NUM_THREADS=1 python benchmarks/search_bench.py --store-index 1000,10000,100000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_model_dir(out: Path) -> Path:
    """A tokenizer-only model directory: config.json and the tiny tokenizer (search needs no weights)."""
    from kvcdn_core.model.tiny import train_tokenizer

    tok = train_tokenizer()
    tok.save_pretrained(out)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": len(tok),
        "hidden_size": 64,
        "num_hidden_layers": 2,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def document(rng: random.Random, tokenizer, min_tokens: int) -> tuple[str, list[int]]:
    """Text of at least ``min_tokens`` tokens, sentences of the sample text in a random order."""
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    sentences = [s.strip() + "." for s in SAMPLE_TEXT.replace("\n", " ").split(".") if s.strip()]
    parts = []
    while True:
        parts.extend(rng.sample(sentences, len(sentences)))
        parts.append(f"(ref {rng.randrange(10**6)})")
        text = " ".join(parts)
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= min_tokens:
            return text, ids


def write_corpus(directory: Path, model_dir: Path, n: int, tokens: int, subdirs: int, seed: int) -> str:
    """Write ``n`` artifacts; return a query whose best match is a whole document plus a question."""
    import torch
    from transformers import AutoTokenizer

    from kvcdn_core import artifact
    from kvcdn_core.model.files import fingerprint

    # A throwaway corpus needs no durability: skip write_artifact's fsyncs (seconds per 100 files on
    # a busy disk). Search itself is unaffected.
    real_fsync, os.fsync = os.fsync, lambda fd: None
    try:
        return _write_corpus(
            directory, model_dir, n, tokens, subdirs, seed, torch, AutoTokenizer, artifact, fingerprint
        )
    finally:
        os.fsync = real_fsync


def _write_corpus(directory, model_dir, n, tokens, subdirs, seed, torch, AutoTokenizer, artifact, fingerprint):
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    fp = fingerprint(model_dir)
    variants = 10
    docs = [document(rng, tok, tokens) for _ in range(max(1, n // variants))]
    layer = {"index": 0, "kind": "full_attention", "tensors": {"key": "layers.0.key", "value": "layers.0.value"}}
    small = {"layers.0.key": torch.zeros(1, 1, 1, 1), "layers.0.value": torch.zeros(1, 1, 1, 1)}
    for i in range(n):
        _, ids = docs[i % len(docs)]
        j = i // len(docs)  # variant j keeps the first j/variants of the document, then diverges
        keep = tokens * j // variants
        other = docs[(i + 1) % len(docs)][1]
        body = (ids[:keep] + other[keep:])[:tokens] if j else ids[:tokens]
        manifest = {
            "kvcdn_version": "bench",
            "created_at": "2026-01-01T00:00:00+00:00",
            "model": {"id": str(model_dir), "revision": None, "family": "qwen", **fp},
            "compute_dtype": "float32",
            "layers": [layer],
            "quantization": None,
            "reuse": "any_prefix",
        }
        tensors = {**small, artifact.TOKEN_IDS: torch.tensor(body, dtype=torch.long)}
        artifact.write_artifact(directory / f"d{i % subdirs:02d}" / f"a{i:05d}.kv", manifest, tensors)
    return docs[0][0] + "\n\nQ: Which ship was missing?\nA:"


def median_time(fn, reps: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (this process and its children) of ``fn``.

    CPU time is reported too because a shared machine stretches wall time with waiting.
    """
    walls, cpus = [], []
    for _ in range(reps):
        before = _cpu()
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(_cpu() - before)
    return statistics.median(walls), statistics.median(cpus)


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def ms(pair: tuple[float, float]) -> str:
    return f"{pair[0] * 1000:.0f} ms ({pair[1] * 1000:.0f} ms CPU)"


def synthetic_state(n: int, tokens: int, seed: int, chunk: int):
    """The index state of ``n`` artifacts shaped like :func:`write_corpus`'s, and queries for them.

    Chain keys are computed chunk by chunk on views of the documents (a variant is a document's head
    and another's tail), so memory stays that of the documents plus the index.
    """
    import numpy as np

    from kvcdn_core.artifact.manifest import ANY_PREFIX
    from kvcdn_core.store import index, keys

    rng = np.random.default_rng(seed)
    fp = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}
    root = keys.root_key(fp, keys.representation("bfloat16", None), chunk)
    variants = 10
    docs = rng.integers(0, 151_936, size=(max(1, n // variants), tokens), dtype=np.int64).astype(np.uint32)
    state = index._State(chunk_tokens=chunk)
    state.roots[root] = {"root": root, "model": dict(fp, id="bench"), "compute_dtype": "bfloat16", "quantization": None}
    bodies = []
    for i in range(n):
        d = i % len(docs)
        j = i // len(docs)
        keep = tokens * j // variants if j else tokens
        own, other = docs[d], docs[(d + 1) % len(docs)]
        edges, parent = [], root
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            if end <= keep:
                piece = own[start:end]
            elif start >= keep:
                piece = other[start:end]
            else:
                piece = np.concatenate([own[start:keep], other[keep:end]])
            parent = keys.child_key(parent, piece)
            edges.append((index._k16(parent), piece))
        op_id = f"{i:032x}"
        state.arts[op_id] = index._Art(op_id, f"d{d:05d}/v{j:02d}", root, tokens, ANY_PREFIX, 0, edges)
        bodies.append((d, j, keep))
    queries = []
    for _ in range(200):
        d, j, keep = bodies[int(rng.integers(len(bodies)))]
        cut = int(rng.integers(1, tokens + 1))  # a prefix of an artifact, then a question of its own
        body = docs[d] if not j else np.concatenate([docs[d][:keep], docs[(d + 1) % len(docs)][keep:]])
        queries.append(np.concatenate([body[:cut], rng.integers(0, 151_936, size=200)]).astype(np.int64))
    return root, state, queries


def store_index_bench(sizes: list[int], tokens: int, seed: int) -> int:
    import numpy as np

    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store import index
    from kvcdn_core.store.keys import CHUNK_TOKENS

    print(
        "| artifacts x tokens | index build | index object | bytes / artifact | load (cold) | lookup p50 | lookup p99 | lookup p50, no refresh |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="kvcdn-index-bench-") as tmp:
            start = time.perf_counter()
            root, state, queries = synthetic_state(n, tokens, seed, CHUNK_TOKENS)
            trie = index._Trie(state)
            blob = trie.to_base(())
            build_s = time.perf_counter() - start
            del state, trie
            backend = LocalStorage(tmp)
            backend.write_bytes(f"{index.BASES}{0:020d}-{0:032x}.kvix", blob)
            del blob
            start = time.perf_counter()
            loaded = index.load(backend)
            load_s = time.perf_counter() - start
            assert len(loaded.trie.arts) == n
            stored = index.stats(backend)["stored_bytes"]

            def timed(refresh: bool) -> list[float]:
                out = []
                for q in queries:
                    t0 = time.perf_counter()
                    hits = index.lookup(backend, root, q, refresh=refresh)
                    out.append(time.perf_counter() - t0)
                    assert hits and hits[0].prefix_tokens >= 1
                return out

            with_refresh, without = timed(True), timed(False)
            p50, p99 = np.percentile(with_refresh, 50) * 1e3, np.percentile(with_refresh, 99) * 1e3
            print(
                f"| {n:,} x {tokens:,} | {build_s:.1f} s | {stored / 1e6:.1f} MB | {stored / n / 1e3:.1f} kB "
                f"| {load_s:.2f} s | {p50:.2f} ms | {p99:.2f} ms | {np.percentile(without, 50) * 1e3:.2f} ms |",
                flush=True,
            )
            index._CACHE.clear()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--subdirs", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="Keep the corpus here (default: a temporary dir).")
    parser.add_argument(
        "--store-index", default=None, help="Comma-separated store sizes: benchmark the chunk store's prefix index."
    )
    args = parser.parse_args(argv)
    if args.store_index:
        return store_index_bench([int(x) for x in args.store_index.split(",")], args.tokens, args.seed)

    from kvcdn_core import search
    from kvcdn_core.search import prefix

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvcdn-search-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(work / "model")
    corpus = work / "artifacts"
    shape = work / "corpus.json"  # a kept corpus of the same shape is reused (--workdir)
    wanted = {k: getattr(args, k) for k in ("artifacts", "tokens", "subdirs", "seed")}
    start = time.perf_counter()
    if shape.is_file() and json.loads(shape.read_text())["shape"] == wanted:
        query = json.loads(shape.read_text())["query"]
    else:
        shutil.rmtree(corpus, ignore_errors=True)
        query = write_corpus(corpus, model_dir, args.artifacts, args.tokens, args.subdirs, args.seed)
        shape.write_text(json.dumps({"shape": wanted, "query": query}))
    write_s = time.perf_counter() - start
    data_mb = sum(p.stat().st_size for p in corpus.rglob("*.kv")) / 1e6

    def drop_indexes():
        for index in [*corpus.rglob(search.INDEX_NAME), *corpus.glob(prefix.PREFIX_NAME)]:
            index.unlink()

    def cold():
        drop_indexes()
        prefix.open_index(corpus, search.scan(corpus))

    def warm():
        return search.search(corpus, query, str(model_dir))

    cold_s = median_time(cold, max(1, args.reps // 2))
    found = warm()
    warm_s = median_time(warm, args.reps)
    scan_s = median_time(lambda: search.scan(corpus), args.reps)
    entries = search.scan(corpus)
    rank_s = median_time(
        lambda: search.rank(entries, found.fingerprint, found.query_ids, found.start_tokens), args.reps
    )
    open_s = median_time(lambda: prefix.open_index(corpus, entries), args.reps)
    index = prefix.open_index(corpus, entries)
    indexed_s = median_time(lambda: index.rank(found.fingerprint, found.query_ids, found.start_tokens), args.reps)
    # end to end without the tokenizer: what the search does, against comparing every artifact
    # (a fresh scan each time: its entries read their ids from the directory indexes when compared)
    through_s = median_time(
        lambda: prefix.open_index(corpus, search.scan(corpus)).rank(
            found.fingerprint, found.query_ids, found.start_tokens
        ),
        args.reps,
    )
    linear_s = median_time(
        lambda: search.rank(search.scan(corpus), found.fingerprint, found.query_ids, found.start_tokens), args.reps
    )
    index_mb = sum(p.stat().st_size for p in corpus.rglob(search.INDEX_NAME)) / 1e6
    prefix_bytes = (corpus / prefix.PREFIX_NAME).stat().st_size

    cmd = [
        sys.executable,
        "-m",
        "kvcdn_core",
        "search",
        "--model",
        str(model_dir),
        "--dir",
        str(corpus),
        "--query",
        query,
        "--format",
        "json",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    def cli():
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        return json.loads(out.stdout)

    result = cli()
    cli_s = median_time(cli, args.reps)
    python_s = median_time(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), args.reps)
    best = result["matches"][0]
    rows = [
        ("artifacts x tokens", f"{args.artifacts} x {args.tokens} in {args.subdirs} directories"),
        (
            "artifact data on disk",
            f"{data_mb:.1f} MB (indexes {index_mb:.1f} MB, prefix index {prefix_bytes / 1e6:.2f} MB, "
            f"{prefix_bytes / args.artifacts:.0f} B / artifact)",
        ),
        ("writing the corpus (or reusing a kept one)", f"{write_s:.1f} s"),
        ("first scan (all headers, indexes and prefix index written)", ms(cold_s)),
        ("warm search in-process (scan + prefix index + tokenizer + rank)", ms(warm_s)),
        ("  of which scan (indexes read, files stat'ed)", ms(scan_s)),
        ("  of which prefix index opened (kept file read, checked)", ms(open_s)),
        ("  of which rank through the prefix index", ms(indexed_s)),
        ("  (linear rank, prefix against every artifact, for comparison)", ms(rank_s)),
        ("scan + prefix index + rank through it (the search without the tokenizer)", ms(through_s)),
        ("scan + linear rank of every artifact, for comparison", ms(linear_s)),
        ("`kvcdn search` command, fresh process", ms(cli_s)),
        ("  bare `python -c pass` on this machine", ms(python_s)),
        (
            "query / best match",
            f"{result['query_tokens']} tokens; prefix {best['prefix_tokens']} of "
            f"{best['artifact_tokens']}, {len(result['matches'])} matches",
        ),
    ]
    print("| measure | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
