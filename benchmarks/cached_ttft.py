"""Where a cached time to first token goes, against its physical limits (Qwen3-0.6B shape, CPU).

`kvcdn benchmark` measures the whole story with many reps of every prefill; a 4096-token prefill
of this shape costs most of a minute of CPU on a 2-core machine. This script measures the cached
side, which it can repeat often enough for stable numbers: per length and scheme it writes an
artifact of a cache with random values of the model's exact shape (loading and hashing time the
bytes, not what they mean; token exactness is what tests/test_fast_load.py checks), quantized with
the scheme's quantizer, then, each from a cold file (the page cache dropped with
posix_fadvise(DONTNEED), as `kvcdn benchmark` does):

- ``read``: a plain buffered read of the file into memory (the limit the load is held to);
- ``load``: ``runtime.load_cache`` with its digest checks (and dequantization), and its parts:
  ``load buffered`` (no direct I/O, no dequantization), ``load unverified`` (no digests),
  ``blake3 1 thread`` (the format's digest of the file's bytes once on one core, from memory: a
  pure-CPU probe, the steadiest number a run gives);
- ``fresh memory``: faulting in as much new memory as the file needs (private, huge pages, one byte
  written per page), as every load does for its buffer: no disk, no hashing, only the machine. On a
  virtual machine whose host reclaims freed memory it moves more between runs than anything else;
- ``question``: the question's forward on the resident cache (the other limit), per length;
- ``TTFT``: load then the question; ``TTFT pipelined``: the streamed load under the question.

One discarded warm-up, then ``--reps`` runs; min / median / max. ``--prefill-reps N`` also times N
full prefills per length (after one short discarded warm-up prefill), for the speedups; without it,
``--prefill-s`` takes prefill seconds measured elsewhere (e.g. ``2048=21.0``).

``--runs 2`` runs the whole measurement twice in one invocation, one run after the other, and ends
with the medians of each timed quantity side by side, their ratio, and a flag on those more than
10% apart: whether the numbers are stable enough to quote.

    python benchmarks/cached_ttft.py --lengths 512,1024,2048,4096 --schemes none,int8 --reps 3 \\
        --prefill-reps 1 --runs 2 [--threads T] [--workdir DIR] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen3_shaped import QWEN3_06B, build_model, model_folder  # noqa: E402

QUESTION = "\n\nQ: Summarize the key claim in one sentence.\nA:"
#: Two medians further apart than this (max / min) are flagged as unstable.
STABLE = 1.10


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


def touch_fresh(size: int) -> None:
    """Fault in ``size`` bytes of new memory the way a load's buffer is (kvcdn_core.artifact.tensor_io)."""
    import numpy as np

    from kvcdn_core.artifact.tensor_io import private_buffer

    buffer = private_buffer(size)
    np.frombuffer(buffer, dtype=np.uint8)[::4096] = 1
    buffer.close()


def measure(session, path: Path, question_ids: list[int], reps: int, question: bool) -> dict[str, list[float]]:
    """Every timed quantity of one artifact, each sample from a cold file; rep 0 is discarded."""
    import copy

    import torch

    from kvcdn_core import artifact, runtime
    from kvcdn_core.artifact import digests
    from kvcdn_core.artifact.pagecache import evict
    from kvcdn_core.benchmark import plain_read

    resident, _ = runtime.load_cache(session, artifact.read_header(path))
    samples: dict[str, list[float]] = {}

    def forward(cache):
        logits, _ = session.adapter.last_logits(session.model, torch.tensor([question_ids]), cache)
        return int(torch.argmax(logits))

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
        cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=stream)
        assert forward(cache) == expected, "the loaded cache continues differently from the resident one"

    with torch.inference_mode():
        for rep in range(reps + 1):  # rep 0: the discarded warm-up
            timed("read", lambda: plain_read(path), rep=rep)
            timed("load", lambda: runtime.load_cache(session, artifact.read_header(path)), rep=rep)
            timed("load buffered", lambda: artifact.load_tensors(artifact.read_header(path), direct=False), rep=rep)
            timed(
                "load unverified",
                lambda: runtime.load_cache(session, artifact.read_header(path), verify_hashes=False),
                rep=rep,
            )
            timed("fresh memory", lambda: touch_fresh(path.stat().st_size), cold=False, rep=rep)
            data = path.read_bytes()
            timed("blake3 1 thread", lambda: digests.hexdigest("blake3", data), cold=False, rep=rep)  # noqa: F821 - timed before the del below
            del data
            if question:
                twin = copy.deepcopy(resident)
                timed("question", lambda: forward(twin), cold=False, rep=rep)
            timed("TTFT", lambda: ttft(False), rep=rep)
            timed("TTFT pipelined", lambda: ttft(True), rep=rep)
    return samples


def measure_prefill(session, tokens: int, reps: int) -> list[float]:
    """``reps`` full prefills of ``tokens`` random token ids plus the first token's argmax, timed."""
    import torch

    from kvcdn_core import runtime

    ids = torch.randint(0, session.model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(7))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        _, logits = runtime.prefill(session, ids.tolist(), progress=False)
        int(torch.argmax(logits))
        times.append(time.perf_counter() - start)
    return times


def one_run(session, work: Path, lengths, schemes, question_ids, reps: int, prefill_reps: int) -> dict:
    """The whole measurement once: ``{tokens: {scheme: {"bytes": n, quantity: [seconds, ...]}}}``;
    the length's prefill and question samples sit with its first scheme."""
    from kvcdn_core.benchmark.measure import quantize

    results: dict[int, dict[str, dict]] = {}
    for tokens in lengths:
        base = random_artifact(session, tokens, work / f"random-{tokens}.kv")
        row = results.setdefault(tokens, {})
        for scheme in schemes:
            path = base if scheme == "none" else quantize(base, scheme, work / f"random-{tokens}.{scheme}.kv")
            first = not row
            row[scheme] = {"bytes": path.stat().st_size, **measure(session, path, question_ids, reps, question=first)}
            if first and prefill_reps:
                row[scheme]["prefill"] = measure_prefill(session, tokens, prefill_reps)
            if path != base:
                path.unlink()
        base.unlink()
    return results


def medians(results: dict) -> dict[tuple[int, str, str], float]:
    return {
        (tokens, scheme, name): statistics.median(values)
        for tokens, row in results.items()
        for scheme, cell in row.items()
        for name, values in cell.items()
        if name != "bytes"
    }


def print_run(results: dict, prefill_given: dict[int, float]) -> None:
    print("\n| tokens | scheme | MB | what | min s | median s | max s | vs read |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for tokens, row in results.items():
        for scheme, cell in row.items():
            read = statistics.median(cell["read"])
            for name, values in cell.items():
                if name == "bytes":
                    continue
                med = statistics.median(values)
                print(
                    f"| {tokens} | {scheme} | {cell['bytes'] / 1e6:.0f} | {name} | {min(values):.3f} | {med:.3f} "
                    f"| {max(values):.3f} | {med / read:.2f}x |"
                )
    print(
        "\n| tokens | scheme | load / read | TTFT pipelined | limit = max(read, question) "
        "| pipelined / (1.1 limit + 20 ms) | prefill | speedup (prefill / TTFT pipelined) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for tokens, row in results.items():
        shared = next(iter(row.values()))  # the length's question and prefill
        question = statistics.median(shared["question"])
        prefill = statistics.median(shared["prefill"]) if "prefill" in shared else prefill_given.get(tokens)
        for scheme, cell in row.items():
            med = {name: statistics.median(v) for name, v in cell.items() if name != "bytes"}
            limit = max(med["read"], question)
            pipelined = med["TTFT pipelined"]
            print(
                f"| {tokens} | {scheme} | {med['load'] / med['read']:.2f}x | {pipelined:.3f} s | {limit:.3f} s "
                f"| {pipelined / (1.1 * limit + 0.02):.2f} | {f'{prefill:.2f} s' if prefill else '-'} "
                f"| {f'{prefill / pipelined:.0f}x' if prefill else '-'} |"
            )


def print_stability(runs: list[dict]) -> int:
    """Each timed quantity's median in every run, side by side, and max / min of them, flagged when
    more than 10% apart; returns how many are."""
    per_run = [medians(run) for run in runs]
    names = " | ".join(f"run {i} s" for i in range(1, len(runs) + 1))
    print(f"\nStability: the medians of the {len(runs)} runs, flagged when more than {STABLE - 1:.0%} apart")
    print(f"\n| tokens | scheme | what | {names} | max / min | |")
    print("|---:|---|---|" + "---:|" * len(runs) + "---:|---|")
    unstable = 0
    for key in per_run[0]:
        values = [run[key] for run in per_run]
        ratio = max(values) / min(values) if min(values) > 0 else float("inf")
        flag = "" if ratio <= STABLE else "**>10% apart**"
        unstable += bool(flag)
        cells = " | ".join(f"{v:.3f}" for v in values)
        print(f"| {key[0]} | {key[1]} | {key[2]} | {cells} | {ratio:.2f} | {flag} |")
    print(f"\n{len(per_run[0]) - unstable} of {len(per_run[0])} medians within {STABLE - 1:.0%} across the runs")
    return unstable


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--schemes", default="none", help="none and installed quantizers, e.g. none,int8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prefill-reps", type=int, default=0, help="timed full prefills per length [default: none]")
    parser.add_argument("--runs", type=int, default=1, help="the whole measurement this many times (2: compare)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads [default: the physical cores]")
    parser.add_argument("--vocab", type=int, default=QWEN3_06B["vocab_size"])
    parser.add_argument("--model", default=None, help="a model directory [default: build the Qwen3-0.6B shape]")
    parser.add_argument("--workdir", default=None, help="model and artifacts [default: a temp dir]")
    parser.add_argument("--prefill-s", default="", help="prefill seconds per length, e.g. 2048=21.0,512=3.1")
    parser.add_argument("--json", default=None, help="also write the samples here")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.runs < 1 or args.prefill_reps < 0:
        parser.error("--reps and --runs must be at least 1, --prefill-reps at least 0")

    from kvcdn_core import runtime
    from kvcdn_core.benchmark import installed_schemes, set_threads
    from kvcdn_core.benchmark.inputs import parse_lengths, parse_schemes
    from kvcdn_core.cores import stream_workers

    lengths = parse_lengths(args.lengths)
    schemes = parse_schemes(args.schemes, installed_schemes())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-cached-ttft-"))
    started = time.perf_counter()
    model = args.model or str(build_model(model_folder(work, args.vocab), args.vocab))
    session = runtime.load_session(model, device="cpu", dtype="float32")
    threads = set_threads(args.threads)
    question_ids = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    prefill_given = {int(k): float(v) for k, v in (p.split("=") for p in args.prefill_s.split(",") if p)}
    if args.prefill_reps:
        measure_prefill(session, 64, 1)  # warm-up: the first forward pays one-time costs
    print(
        f"threads: {threads} (torch), {stream_workers(threads)} (streamed load's workers); reps: {args.reps} "
        f"after a discarded warm-up; prefill reps: {args.prefill_reps}; question: {len(question_ids)} tokens; "
        f"OMP_WAIT_POLICY: {os.environ.get('OMP_WAIT_POLICY', 'unset')}",
        flush=True,
    )
    runs = []
    for number in range(1, args.runs + 1):
        load_start = os.getloadavg()[0]
        runs.append(one_run(session, work, lengths, schemes, question_ids, args.reps, args.prefill_reps))
        print(
            f"\n## Run {number} of {args.runs}: 1-minute load average {load_start:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end"
        )
        print_run(runs[-1], prefill_given)
        sys.stdout.flush()
    if len(runs) > 1:
        print_stability(runs)
    print(f"\nwall time: {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": threads, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
