"""Time to first token in vLLM for a ~2k-token SmolLM2 prompt: cold, loaded from a kvcdn artifact,
and loaded by vLLM's bundled disk example connector (``ExampleConnector``) from its own files.

Run with the vLLM environment's Python (``scripts/vllm-venv.sh`` builds ``.venv-vllm``):

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--tokens 2048] [--reps 3] [--json out.json]

Each configuration is a fresh engine (float32, eager, vLLM's own prefix cache off, so every reused
token comes from the connector). TTFT is the wall time of one request with ``max_tokens=1``;
``reps`` requests per configuration, the first and the median are reported. kvcdn keeps the last
artifact it read in memory, so its repeats skip the file read; the first request does not.
Bytes moved: the artifact file kvcdn reads; the files the example connector writes and reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from vllm_engines import close, dir_bytes, document_ids, engine, kvcdn, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens (about)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from kvcdn_core import runtime
    from kvcdn_core.testing.smollm2 import smollm2_dir

    model = smollm2_dir()
    work = Path(tempfile.mkdtemp(prefix="kvcdn-vllm-bench-"))
    try:
        session = runtime.load_session(str(model), device="cpu", dtype="float32")
        context_ids = document_ids(session, args.tokens - 16)
        question = session.adapter.encode_continuation(session.tokenizer, " Question: what did the keeper write?")
        prompt = context_ids + question
        artifacts = work / "kvcdn"
        runtime.save_cache(
            session, runtime.prefill(session, context_ids, progress=False)[0], context_ids, "", artifacts / "context.kv"
        )
        del session
        gc.collect()

        results = {
            "prompt_tokens": len(prompt),
            "reps": args.reps,
            "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }

        llm = engine(str(model), None)
        times, out = ttft(llm, prompt, args.reps)
        results["cold"] = {
            "first_s": times[0],
            "median_s": statistics.median(times),
            "times_s": times,
            "cached_tokens": 0,
        }
        close(llm)

        llm = engine(str(model), kvcdn({"source": str(artifacts)}))
        times, out = ttft(llm, prompt, args.reps)
        results["kvcdn"] = {
            "first_s": times[0],
            "median_s": statistics.median(times),
            "times_s": times,
            "cached_tokens": out.num_cached_tokens,
            "bytes_read": (artifacts / "context.kv").stat().st_size,
        }
        close(llm)

        example_dir = work / "example"
        example_dir.mkdir()
        llm = engine(
            str(model),
            {
                "kv_connector": "ExampleConnector",
                "kv_connector_extra_config": {"shared_storage_path": str(example_dir)},
            },
        )
        store_times, _ = ttft(llm, prompt, 1)  # the first request computes and stores
        written = dir_bytes(example_dir)
        times, out = ttft(llm, prompt, args.reps)
        results["example_connector"] = {
            "first_s": times[0],
            "median_s": statistics.median(times),
            "times_s": times,
            "cached_tokens": out.num_cached_tokens,
            "bytes_written": written,
            "bytes_read": written,
            "storing_request_s": store_times[0],
        }
        close(llm)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    cold = results["cold"]["median_s"]
    for name in ("kvcdn", "example_connector"):
        r = results[name]
        r["share_of_prompt"] = r["cached_tokens"] / results["prompt_tokens"]
        r["speedup_vs_cold_median"] = cold / r["median_s"]
        r["speedup_vs_cold_first"] = results["cold"]["first_s"] / r["first_s"]
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
