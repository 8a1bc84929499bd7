"""Where a cached time to first token goes, against its physical limits (Qwen3-0.6B shape, CPU).

`kvcdn benchmark` measures the whole story, prefill included; a 2048-token prefill of this shape
costs minutes of CPU on a busy 2-core machine. This script measures only the cached side, so it
can repeat it often enough for stable numbers: per length it writes an artifact of a cache with
random values of the model's exact shape (loading and hashing time the bytes, not what they mean;
token exactness is what tests/test_fast_load.py checks), then, each from a cold file (the page
cache dropped with posix_fadvise(DONTNEED), as `kvcdn benchmark` does):

- ``read``: a plain buffered read of the file into memory (the limit the load is held to);
- ``load``: ``runtime.load_cache`` with its sha256 checks, and its parts: ``load buffered`` (no
  direct I/O), ``load unverified`` (no sha256), ``sha256 1 thread`` (hashing the file's bytes once
  on one core, from memory);
- ``question``: the question's forward on the resident cache (the other limit);
- ``TTFT``: load then the question; ``TTFT pipelined``: the streamed load under the question.

One discarded warm-up, then ``--reps`` runs; min / median / max. With ``--prefill-s`` (prefill
seconds per length measured by `kvcdn benchmark`, e.g. ``2048=21.0``) it adds the speedups.

    python benchmarks/cached_ttft.py --lengths 512,1024,2048,4096 --reps 5 --threads 2 [--workdir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen3_shaped import QWEN3_06B, build_model  # noqa: E402

QUESTION = "\n\nQ: Summarize the key claim in one sentence.\nA:"


def random_artifact(session, tokens: int, path: Path) -> Path:
    """An artifact of a random cache with the model's exact layout, written by the real writer."""
    import torch

    from kvcdn_core import runtime

    config = session.model.config
    torch.manual_seed(tokens)
    cache = session.adapter.new_cache(session.model)
    shape = (1, config.num_key_value_heads, tokens, config.head_dim)
    for index in range(config.num_hidden_layers):
        cache.update(torch.randn(shape), torch.randn(shape), index)
    ids = torch.randint(0, config.vocab_size, (tokens,)).tolist()
    return runtime.save_cache(session, cache, ids, "random cache of the model's shape", path)


def measure(session, path: Path, question_ids: list[int], reps: int) -> dict[str, list[float]]:
    import copy

    import torch

    from kvcdn_core import artifact as fmt
    from kvcdn_core import runtime
    from kvcdn_core.benchmark import plain_read
    from kvcdn_core.pagecache import evict

    resident, _ = runtime.load_cache(session, fmt.read_header(path))
    samples: dict[str, list[float]] = {}

    def forward(cache):
        out, _ = session.adapter.forward(session.model, torch.tensor([question_ids]), cache)
        return int(torch.argmax(out[0, -1]))

    expected = forward(copy.deepcopy(resident))

    def timed(name, fn, cold=True, rep=0):
        if cold:
            evict(path)
        start = time.perf_counter()
        result = fn()
        if rep:
            samples.setdefault(name, []).append(time.perf_counter() - start)
        return result

    def ttft(stream):
        cache, _ = runtime.load_cache(session, fmt.read_header(path), stream=stream)
        assert forward(cache) == expected, "the loaded cache continues differently from the resident one"

    with torch.inference_mode():
        for rep in range(reps + 1):  # rep 0: the discarded warm-up
            timed("read", lambda: plain_read(path), rep=rep)
            timed("load", lambda: runtime.load_cache(session, fmt.read_header(path)), rep=rep)
            timed("load buffered", lambda: fmt.load_tensors(fmt.read_header(path), direct=False), rep=rep)
            timed(
                "load unverified",
                lambda: runtime.load_cache(session, fmt.read_header(path), verify_hashes=False),
                rep=rep,
            )
            data = path.read_bytes()
            timed("sha256 1 thread", lambda: hashlib.sha256(data).digest(), cold=False, rep=rep)  # noqa: F821 - timed before the del below
            del data
            twin = copy.deepcopy(resident)
            timed("question", lambda: forward(twin), cold=False, rep=rep)
            timed("TTFT", lambda: ttft(False), rep=rep)
            timed("TTFT pipelined", lambda: ttft(True), rep=rep)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads [default: the physical cores]")
    parser.add_argument("--vocab", type=int, default=QWEN3_06B["vocab_size"])
    parser.add_argument("--workdir", default=None, help="model and artifacts [default: a temp dir]")
    parser.add_argument("--prefill-s", default="", help="prefill seconds per length, e.g. 2048=21.0,512=3.1")
    parser.add_argument("--json", default=None, help="also write the samples here")
    args = parser.parse_args(argv)

    from kvcdn_core import runtime
    from kvcdn_core.benchmark import set_threads

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-cached-ttft-"))
    session = runtime.load_session(
        str(build_model(work / f"qwen3-0.6b-shaped-v{args.vocab}", args.vocab)), device="cpu", dtype="float32"
    )
    threads = set_threads(args.threads)
    question_ids = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    prefill = {int(k): float(v) for k, v in (p.split("=") for p in args.prefill_s.split(",") if p)}
    load_start = os.getloadavg()[0]
    results = {}
    for tokens in (int(t) for t in args.lengths.split(",")):
        path = random_artifact(session, tokens, work / f"random-{tokens}.kv")
        results[tokens] = {"bytes": path.stat().st_size, **measure(session, path, question_ids, args.reps)}
        path.unlink()
    print(
        f"threads: {threads}; reps: {args.reps} after a discarded warm-up; 1-minute load average "
        f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; question: {len(question_ids)} tokens"
    )
    print("\n| tokens | MB | what | min s | median s | max s | vs read |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for tokens, row in results.items():
        read = statistics.median(row["read"])
        for name, values in row.items():
            if name == "bytes":
                continue
            med = statistics.median(values)
            print(
                f"| {tokens} | {row['bytes'] / 1e6:.0f} | {name} | {min(values):.3f} | {med:.3f} | {max(values):.3f} "
                f"| {med / read:.2f}x |"
            )
    print(
        "\n| tokens | load / read | TTFT pipelined | limit = max(read, question) | pipelined / (1.1 limit + 20 ms) "
        "| speedup (prefill / TTFT pipelined) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for tokens, row in results.items():
        med = {name: statistics.median(v) for name, v in row.items() if name != "bytes"}
        limit = max(med["read"], med["question"])
        speedup = f"{prefill[tokens] / med['TTFT pipelined']:.0f}x" if tokens in prefill else "-"
        print(
            f"| {tokens} | {med['load'] / med['read']:.2f}x | {med['TTFT pipelined']:.3f} s | {limit:.3f} s "
            f"| {med['TTFT pipelined'] / (1.1 * limit + 0.02):.2f} | {speedup} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": threads, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
