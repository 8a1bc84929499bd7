"""Measure kvcdn's quantization schemes: compression, dequantization speed, load time, and quality
on a model with trained weights (the numbers in docs/quantization.md come from one run of this).

1. Compression: the float16 artifact of a 2,048-token context, from a model with the attention
   layout of Qwen3-0.6B (8 KV heads, head_dim 128; two layers: the ratio does not depend on depth),
   quantized with every installed scheme at ``--residual 0``, file bytes against file bytes; then the
   low-bit schemes again with their default 128-token residual window, to show what it costs.
2. Speed: dequantization throughput (GB/s of float16 output) and the time to load the artifact into a
   cache (``runtime.load_cache``), quantized against unquantized, median of several runs.
3. Quality: random weights say little about quantization error, so this trains a small Qwen3-style
   model (4 layers, hidden 128) for a few minutes on CPU on the docstrings of Python's standard
   library, then, over many held-out contexts and questions, compares each scheme's continuation
   with a full prefill: free-running token agreement, exact sequences, and teacher-forced max logit
   difference and KL divergence.

    OMP_NUM_THREADS=1 python benchmarks/quant_report.py [--train-seconds 180] [--contexts 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMES = [("int8-tensor", {}), ("int8", {}), ("fp8", {}), ("int4", {"residual": 0}), ("int2", {"residual": 0})]
WITH_RESIDUAL = [("int4", {}), ("int2", {})]  # default residual 128


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def installed(schemes):
    from kvcdn_core.registry import quantizer_classes

    have = quantizer_classes()
    missing = sorted({s for s, _ in schemes} - set(have))
    if missing:
        log(f"note: schemes not installed, left out: {', '.join(missing)} (pip install -e plugins/kvcdn-quant-lowbit)")
    return [(s, p) for s, p in schemes if s in have]


def label(scheme, params):
    if not params and scheme in ("int4", "int2"):
        return f"{scheme} r128"
    return scheme + (" r0" if params.get("residual") == 0 else "")


def quantize_file(src: Path, scheme: str, params: dict, out: Path) -> Path:
    from kvcdn_core import artifact, quant
    from kvcdn_core.registry import quantizer_for

    header = artifact.read_header(src)
    result = quant.quantize_cache(header.manifest, artifact.load_tensors(header), quantizer_for(scheme)(**params))
    return artifact.write_artifact(out, result.manifest, result.tensors)


def median_time(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- 1 and 2: compression and speed ------------------------------------------------------------------


def compression_and_speed(workdir: Path) -> dict:
    from kvcdn_model_qwen import QwenAdapter

    from kvcdn_core import artifact, quant, runtime
    from kvcdn_core.tiny import build_tiny_model
    from kvcdn_core.validation import long_context

    class Shaped(QwenAdapter):
        validation_configs = {
            "Qwen3ForCausalLM": dict(
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
            )
        }

    model_dir = build_tiny_model(Shaped, "Qwen3ForCausalLM", workdir / "shaped", init_std=0.02)
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float16")
    text = long_context(2048, session.tokenizer)
    ids = session.adapter.encode_context(session.tokenizer, text)[:2048]
    cache, _ = runtime.prefill(session, ids, chunk=256, progress=False)
    base = runtime.save_cache(session, cache, ids, "(2048-token benchmark context)", workdir / "ctx2k.kv")
    base_bytes = base.stat().st_size
    base_header = artifact.read_header(base)
    out_bytes = sum(
        t.numel() * t.element_size() for n, t in artifact.load_tensors(base_header).items() if n != artifact.TOKEN_IDS
    )
    rows = []
    for scheme, params in installed(SCHEMES) + installed(WITH_RESIDUAL):
        out = quantize_file(base, scheme, params, workdir / f"ctx2k.{label(scheme, params).replace(' ', '-')}.kv")
        header = artifact.read_header(out)
        deq = median_time(lambda: quant.dequantize_tensors(header, verify_hashes=False))
        load_q = median_time(lambda: runtime.load_cache(session, header, verify_hashes=False))
        rows.append(
            {
                "scheme": label(scheme, params),
                "bytes": out.stat().st_size,
                "ratio": base_bytes / out.stat().st_size,
                "dequant_gbps": out_bytes / deq / 1e9,
                "dequant_ms": deq * 1e3,
                "load_ms": load_q * 1e3,
            }
        )
    load_plain = median_time(lambda: runtime.load_cache(session, base_header, verify_hashes=False))
    return {
        "tokens": len(ids),
        "float16_bytes": base_bytes,
        "load_unquantized_ms": load_plain * 1e3,
        "layout": "2 layers x 8 KV heads x head_dim 128, float16",
        "rows": rows,
    }


# -- 3: quality on a trained model -------------------------------------------------------------------


def stdlib_docstrings() -> list[str]:
    """Docstrings of the standard library's own modules, read with ast (nothing is imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:] or path.parent.name in ("idlelib", "lib2to3", "tkinter", "test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    docs.append(doc.strip())
    return docs


def train_tokenizer(texts, vocab_size=1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def train_model(workdir: Path, train_docs, seconds: float, seed: int = 0) -> tuple[Path, dict]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tokenizer = train_tokenizer(train_docs)
    eos = tokenizer.eos_token_id
    stream = []
    for doc in train_docs:
        stream += tokenizer(doc)["input_ids"] + [eos]
    data = torch.tensor(stream)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    seq, batch = 128, 8
    start, step, losses = time.perf_counter(), 0, []
    model.train()
    while time.perf_counter() - start < seconds:
        frac = (time.perf_counter() - start) / seconds
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        idx = torch.randint(0, len(data) - seq - 1, (batch,))
        x = torch.stack([data[i : i + seq] for i in idx])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 100 == 0:
            log(f"  step {step}, loss {statistics.mean(losses[-100:]):.3f}, {time.perf_counter() - start:.0f}s")
    model.eval()
    out = workdir / "trained"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, {
        "steps": step,
        "tokens_seen": step * seq * batch,
        "corpus_tokens": len(stream),
        "final_loss": statistics.mean(losses[-50:]),
        "seconds": round(time.perf_counter() - start),
    }


def quality(workdir: Path, model_dir: Path, eval_docs, contexts: int, n: int, schemes=None) -> list[dict]:
    import torch

    from kvcdn_core import artifact, runtime
    from kvcdn_core.verify import cached, reference

    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    tok = session.tokenizer
    cases, pending = [], []
    for doc in eval_docs:  # held-out docstrings, joined until a context has 384-512 tokens
        pending += tok(doc)["input_ids"] + [tok.eos_token_id]
        if len(pending) >= 400:
            cut = min(len(pending) - 8, 512)
            cases.append((pending[:cut], pending[cut : cut + 8]))  # context, then the next 8 tokens as the question
            pending = []
        if len(cases) == contexts:
            break
    schemes = installed(schemes or SCHEMES + WITH_RESIDUAL)
    stats = {
        label(s, p): {"match": 0, "exact": 0, "max_dlogit": 0.0, "kl": [], "tf_agree": 0, "flip_margins": []}
        for s, p in schemes
    }
    total, margins = 0, []
    for k, (ctx_ids, q_ids) in enumerate(cases):
        cache, _ = runtime.prefill(session, ctx_ids, progress=False)
        src = runtime.save_cache(session, cache, ctx_ids, f"eval context {k}", workdir / "eval.kv")
        ref_ids, ref_logits = reference(session, ctx_ids, q_ids, n)
        total += n
        ref_margins = [float(v[0] - v[1]) for v in (step.topk(2).values for step in ref_logits)]
        margins += ref_margins
        for scheme, params in schemes:
            s = stats[label(scheme, params)]
            header = artifact.read_header(quantize_file(src, scheme, params, workdir / "eval.q.kv"))
            ids, _, _ = cached(session, header, q_ids, n)
            _, logits, _ = cached(session, header, q_ids, n, forced=ref_ids)
            s["match"] += sum(a == b for a, b in zip(ref_ids, ids))
            s["exact"] += ids == ref_ids
            for step, (a, b) in enumerate(zip(ref_logits, logits)):
                if int(a.argmax()) != int(b.argmax()):
                    s["flip_margins"].append(ref_margins[step])
                s["max_dlogit"] = max(s["max_dlogit"], float((a - b).abs().max()))
                pa, pb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
                s["kl"].append(max(float((pa.exp() * (pa - pb)).sum()), 0.0))
                s["tf_agree"] += int(a.argmax()) == int(b.argmax())
        log(f"  context {k + 1}/{len(cases)} ({len(ctx_ids)} tokens)")
    rows = []
    for name, s in stats.items():
        rows.append(
            {
                "scheme": name,
                "contexts": len(cases),
                "token_agreement": s["match"] / total,
                "exact_sequences": s["exact"],
                "teacher_forced_argmax": s["tf_agree"] / total,
                "max_abs_logit_diff": s["max_dlogit"],
                "mean_kl": statistics.mean(s["kl"]),
                "max_kl": max(s["kl"]),
                "largest_flipped_margin": max(s["flip_margins"], default=None),
            }
        )
    near = sum(m < 0.05 for m in margins)
    return {
        "rows": rows,
        "steps": total,
        "reference_steps_with_margin_below_0.05": near,
        "median_reference_margin": statistics.median(margins),
    }


def print_quality(q: dict, n: int) -> None:
    """The quality table of :func:`quality` as markdown (what docs/quantization.md shows)."""
    print(
        f"{q['rows'][0]['contexts'] if q['rows'] else 0} held-out contexts of 400-512 tokens, "
        f"8-token questions, {n} greedy tokens; {q['steps']} reference steps, "
        f"{q['reference_steps_with_margin_below_0.05']} of them near-ties (top-2 margin < 0.05), "
        f"median margin {q['median_reference_margin']:.2f}\n"
    )
    print(
        "| scheme | token agreement | exact sequences | teacher-forced argmax | largest margin flipped | "
        "max abs logit diff | mean KL | max KL |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in q["rows"]:
        flipped = "-" if r["largest_flipped_margin"] is None else f"{r['largest_flipped_margin']:.3f}"
        print(
            f"| {r['scheme']} | {100 * r['token_agreement']:.1f}% | {r['exact_sequences']}/{r['contexts']} | "
            f"{100 * r['teacher_forced_argmax']:.1f}% | {flipped} | {r['max_abs_logit_diff']:.3f} | "
            f"{r['mean_kl']:.2e} | {r['max_kl']:.2e} |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-seconds", type=float, default=180)
    parser.add_argument("--contexts", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    import torch

    from kvcdn_core.contracts.adapter import quiet_transformers

    quiet_transformers()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-quant-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"torch_threads": torch.get_num_threads()}
    log("compression and speed (2,048-token float16 artifact)")
    report["compression"] = compression_and_speed(workdir)
    docs = stdlib_docstrings()
    random.Random(0).shuffle(docs)
    held = max(args.contexts * 8, len(docs) // 10)
    log(f"training on {len(docs) - held} docstrings for {args.train_seconds:.0f}s")
    model_dir, report["training"] = train_model(workdir, docs[held:], args.train_seconds)
    log("quality against a full prefill")
    report["quality"] = quality(workdir, model_dir, docs[:held], args.contexts, args.n)
    c = report["compression"]
    print(f"\n### Compression ({c['tokens']} tokens, {c['layout']}; float16 artifact {c['float16_bytes']:,} bytes)\n")
    print("| scheme | file bytes | ratio vs float16 | dequantize (GB/s of float16 out) | load into cache (ms) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| none (float16) | {c['float16_bytes']:,} | 1.00x | - | {c['load_unquantized_ms']:.1f} |")
    for r in c["rows"]:
        print(f"| {r['scheme']} | {r['bytes']:,} | {r['ratio']:.2f}x | {r['dequant_gbps']:.2f} | {r['load_ms']:.1f} |")
    t = report["training"]
    print(
        f"\n### Quality (trained model: {t['steps']} steps, {t['tokens_seen']:,} tokens seen, "
        f"final loss {t['final_loss']:.2f}, {t['seconds']}s)\n"
    )
    print_quality(report["quality"], args.n)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
