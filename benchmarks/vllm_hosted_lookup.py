"""The vLLM connector's per-request lookup against the hosted service, timed.

A fresh ``kvcdn serve`` (SQLite, local storage) holding ``--artifacts`` small synthetic artifacts,
each uploaded by chunks (real uploads, so each has its chunk record). Then ``--queries`` prompts
(a random artifact's first ``--prefix`` tokens, then 50 new tokens) through the connector's own
scheduler-side lookup (:class:`kvcdn_vllm.lookup.IndexLookup`: the service's prefix lookup, one
request whose answer carries the best match's chunk grant), timed end to end over loopback: p50
and p99, and how many lookups also needed the chunks route (the server granted another match than
the client picked). Then the same prompts again. The issue's goal is at most 5 ms added per request.

    OMP_NUM_THREADS=1 python benchmarks/vllm_hosted_lookup.py --artifacts 1000
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FINGERPRINT = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": None}


def run(artifacts: int, tokens: int, prefix: int, queries: int, seed: int) -> str:
    from kvcdn_vllm import lookup

    from kvcdn_core import artifact
    from tests.support import services
    from tests.support.hosted import mint_key
    from tests.support.storefiles import write_kinds

    with tempfile.TemporaryDirectory() as tmp_name, services.kvcdn_server(Path(tmp_name) / "home") as server:
        tmp = Path(tmp_name)
        os.environ["KVCDN_TELEMETRY"] = "0"
        os.environ["KVCDN_API_KEY"] = mint_key(server.url, server.admin_secret(), "bench")
        root = lookup.engine_root(FINGERPRINT, "float32")
        finder = lookup.open_lookup("kvcdn+" + server.url, root, print)
        assert isinstance(finder, lookup.IndexLookup)

        def put(i: int) -> list[int]:
            path = tmp / f"a{i:05d}.kv"
            tensors = write_kinds(path, ["full_attention"] * 2, tokens, seed=seed * 1_000_003 + i)
            finder.backend.upload_chunked(path, f"a{i:05d}")
            path.unlink()
            return tensors[artifact.TOKEN_IDS].tolist()

        began = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(put, range(artifacts)))
        loaded_s = time.perf_counter() - began
        rng = random.Random(seed)
        prompts = []
        for _ in range(queries):
            i = rng.randrange(artifacts)
            prompts.append(ids[i][:prefix] + [rng.randrange(50_000) for _ in range(50)])

        asked = []  # chunks-route requests: the grant in the answer was not the client's pick
        hit_chunks = finder.backend.hit_chunks
        finder.backend.hit_chunks = lambda hit: asked.append(hit) or hit_chunks(hit)  # type: ignore[method-assign]

        def timed() -> tuple[str, int]:
            asked.clear()
            times, matched = [], 0
            for prompt in prompts:
                t0 = time.perf_counter()
                match = finder.lookup(prompt)
                times.append((time.perf_counter() - t0) * 1000)
                matched += match is not None and match.prefix_tokens >= prefix
            times.sort()
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            median = statistics.median(times)
            return f"p50 {median:.1f} ms, p99 {p99:.1f} ms, {len(asked)} needed the chunks route", matched

        first, matched = timed()
        again, _ = timed()
        return (
            f"{artifacts} artifacts of {tokens} tokens (uploaded in {loaded_s:.0f} s); {queries} lookups of a "
            f"{prefix}-token prefix: {first} ({matched}/{queries} found whole); the same again: {again}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prefix", type=int, default=400)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(run(args.artifacts, args.tokens, args.prefix, args.queries, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
