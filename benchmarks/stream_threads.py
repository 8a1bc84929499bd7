"""How many loader threads a streamed load should use next to torch's: ratios taken within one run.

The streamed load's workers (digest checks, dequantization, import) run while torch runs the question's
forward; on a small machine they compete for the same cores. This script times, for each torch
thread count and each worker count, the cached first token loaded whole then asked (``TTFT``) and
streamed under the question (``TTFT pipelined``), on a mid-size Qwen3 shape with a random cache,
each from a cold file. Configurations are interleaved rep by rep, so that a machine that other jobs
keep busy slows all of them alike: compare the ratios, not the seconds. OpenMP's wait policy is
read when torch loads, so compare it between runs: ``OMP_WAIT_POLICY=PASSIVE python ...``.

    python benchmarks/stream_threads.py [--tokens 2048] [--reps 5] [--schemes none,int8] [--threads 1,2]
                                        [--workers 1,2,4] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cached_ttft import QUESTION, random_artifact  # noqa: E402

#: A mid-size Qwen3 (38M parameters, 24.6 kB of float32 cache per token): big enough that a forward
#: and a load take tens of milliseconds, small enough to build in seconds.
MID_QWEN3 = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=8192,
)


def build_mid_model(out: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvcdn_core.model.tiny import train_tokenizer

    if (out / "config.json").exists():
        return out
    tokenizer = train_tokenizer()
    config = Qwen3Config(**MID_QWEN3, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--schemes", default="none,int8")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to try")
    parser.add_argument("--workers", default="1,2,4", help="streamed-load worker counts to try")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)

    import torch

    from kvcdn_core import artifact, cores, runtime
    from kvcdn_core.artifact.pagecache import evict
    from kvcdn_core.benchmark.measure import quantize

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-stream-threads-"))
    session = runtime.load_session(str(build_mid_model(work / "mid-qwen3")), device="cpu", dtype="float32")
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    base = random_artifact(session, args.tokens, work / "random.kv")
    size = base.stat().st_size
    paths = {s: base if s == "none" else quantize(base, s, work / f"random.{s}.kv") for s in args.schemes.split(",")}
    configs = list(
        itertools.product(paths, [int(t) for t in args.threads.split(",")], [int(w) for w in args.workers.split(",")])
    )
    samples: dict[tuple, dict[str, list[float]]] = {c: {"TTFT": [], "TTFT pipelined": []} for c in configs}
    default = cores.stream_workers

    def ttft(path, stream: bool) -> float:
        evict(path)
        start = time.perf_counter()
        cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=stream)
        session.adapter.last_logits(session.model, torch.tensor([question]), cache)
        return time.perf_counter() - start

    load_start = os.getloadavg()[0]
    try:
        with torch.inference_mode():
            for rep in range(args.reps + 1):  # rep 0: the discarded warm-up
                for scheme, threads, workers in configs:
                    torch.set_num_threads(threads)
                    cores.stream_workers = lambda _threads, n=workers: n
                    whole, streamed = ttft(paths[scheme], False), ttft(paths[scheme], True)
                    if rep:
                        samples[(scheme, threads, workers)]["TTFT"].append(whole)
                        samples[(scheme, threads, workers)]["TTFT pipelined"].append(streamed)
    finally:
        cores.stream_workers = default
        for path in paths.values():
            path.unlink(missing_ok=True)
    print(
        f"{args.tokens} tokens, {size / 1e6:.0f} MB unquantized; "
        f"{args.reps} reps after a warm-up; 1-minute load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; {cores.physical_cores()} physical cores; "
        f"OMP_WAIT_POLICY: {os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    print(
        "\n| scheme | torch threads | workers | TTFT s | TTFT pipelined s | pipelined / sequential (median of reps) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for (scheme, threads, workers), got in samples.items():
        whole, streamed = statistics.median(got["TTFT"]), statistics.median(got["TTFT pipelined"])
        ratio = statistics.median(b / a for a, b in zip(got["TTFT"], got["TTFT pipelined"]))
        print(f"| {scheme} | {threads} | {workers} | {whole:.4f} | {streamed:.4f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
