"""Benchmark `kvcdn search` over many synthetic artifacts (default: 1,000 of 4,000 tokens each).

Search reads headers and token ids only, so the artifacts carry real token ids (the tiny tokenizer's
encoding of generated text) around one-element cache tensors: cheap to write, identical to search.
They are grouped like real use: documents, and variants of each that share a prefix of the
document of every length, spread over several subdirectories (one index file each).

Timed: the first scan (every header read, indexes written), a warm in-process search (indexes
read, tokenizer loaded, query tokenized and ranked), and the whole `kvcdn search` command in a
fresh process (Python start-up and plugin discovery included), each the median of --reps runs.

    OMP_NUM_THREADS=1 python benchmarks/search_bench.py [--artifacts 1000] [--tokens 4000] [--reps 5]
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
    from kvcdn_core.tiny import train_tokenizer

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
    from kvcdn_core.tiny import SAMPLE_TEXT

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
    from kvcdn_core.model_files import fingerprint

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--subdirs", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="Keep the corpus here (default: a temporary dir).")
    args = parser.parse_args(argv)

    from kvcdn_core import search

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvcdn-search-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(work / "model")
    corpus = work / "artifacts"
    shutil.rmtree(corpus, ignore_errors=True)
    start = time.perf_counter()
    query = write_corpus(corpus, model_dir, args.artifacts, args.tokens, args.subdirs, args.seed)
    write_s = time.perf_counter() - start
    data_mb = sum(p.stat().st_size for p in corpus.rglob("*.kv")) / 1e6

    def drop_indexes():
        for index in corpus.rglob(search.INDEX_NAME):
            index.unlink()

    def cold():
        drop_indexes()
        search.scan(corpus)

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
    index_mb = sum(p.stat().st_size for p in corpus.rglob(search.INDEX_NAME)) / 1e6

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
        ("artifact data on disk", f"{data_mb:.1f} MB (indexes {index_mb:.1f} MB)"),
        ("writing the corpus", f"{write_s:.1f} s"),
        ("first scan (all headers, indexes written)", ms(cold_s)),
        ("warm search in-process (scan + tokenizer + rank)", ms(warm_s)),
        ("  of which scan (indexes read, files stat'ed)", ms(scan_s)),
        ("  of which rank (prefix against every artifact)", ms(rank_s)),
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
