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
   library, then, over many 512-token slices of held-out docstrings, compares each scheme with the
   float32 cache of the same context (:func:`quality`, shared with ``quant_smollm2.py``):
   teacher-forced argmax agreement and KL divergence over the next tokens of the text, and whether
   a greedy continuation stays identical.

    OMP_NUM_THREADS=1 python benchmarks/quant_report.py [--train-seconds 180] [--contexts 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import itertools
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
    from kvcdn_core.plugin_host.registry import quantizer_classes

    have = quantizer_classes()
    missing = sorted({s for s, _ in schemes} - set(have))
    if missing:
        log(f"note: schemes not installed, left out: {', '.join(missing)} (pip install -e plugins/kvcdn-quant-lowbit)")
    return [(s, p) for s, p in schemes if s in have]


def label(scheme, params):
    """The scheme's name, with its residual window where it has one (``int4 r128``, ``int4 r0``)."""
    from kvcdn_core.plugin_host.registry import quantizer_for

    residual = {**quantizer_for(scheme).default_params, **params}.get("residual")
    return scheme if residual is None else f"{scheme} r{residual}"


def quantize_file(src: Path, scheme: str, params: dict, out: Path) -> Path:
    from kvcdn_core import artifact
    from kvcdn_core.plugin_host.registry import quantizer_for
    from kvcdn_core.quant import codec

    header = artifact.read_header(src)
    result = codec.quantize_cache(header.manifest, artifact.load_tensors(header), quantizer_for(scheme)(**params))
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

    from kvcdn_core import artifact, runtime
    from kvcdn_core.exactness.architecture import long_context
    from kvcdn_core.model.tiny import build_tiny_model
    from kvcdn_core.quant import codec

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
        deq = median_time(lambda: codec.dequantize_tensors(header, verify_hashes=False))
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


def library_files(root: Path) -> list[Path]:
    """The standard library's modules, one package level deep, less tests, IDLE, lib2to3, tkinter
    and whatever is installed in its site-packages."""
    skip = ("idlelib", "lib2to3", "tkinter", "test", "site-packages", "dist-packages")
    paths = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    return [p for p in paths if "test" not in p.parts[-2:] and p.parent.name not in skip]


def stdlib_docstrings() -> list[str]:
    """Docstrings of the standard library's own modules, read with ast (nothing is imported)."""
    docs = []
    for path in library_files(Path(sysconfig.get_paths()["stdlib"])):
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


def stdlib_sources() -> list[tuple[str, str]]:
    """The standard library's own source files and its LICENSE.txt: ``(path relative to it, text)``.

    Varied text (code, comments, docstrings, legal prose) that every Python install carries, so the
    contexts cut from it need no download.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in [root / "LICENSE.txt", *library_files(root)]:
        try:
            out.append((path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return out


def text_slices(tokenizer, texts, lengths, per_length: int, continuation: int, seed: int = 0) -> list[dict]:
    """``per_length`` cases per context length, cut at a random token offset of a random text.

    A case is a context of that many tokens and the ``continuation`` tokens that follow it in the
    text. Texts are taken in a shuffled order, each once per length while there are enough; the
    choice depends only on ``seed``, the texts and the tokenizer, and every case records its
    ``source`` and token ``start`` so that it can be cut again.
    """
    rng = random.Random(seed)
    token_ids = {}
    cases = []
    for length in lengths:
        need = length + continuation
        candidates = [i for i, (_, text) in enumerate(texts) if len(text) >= need]  # a token has >= 1 character
        rng.shuffle(candidates)
        picked = 0
        for i in itertools.islice(itertools.cycle(candidates), 20 * per_length):
            if i not in token_ids:
                token_ids[i] = tokenizer(texts[i][1], add_special_tokens=False)["input_ids"]
            ids = token_ids[i]
            if len(ids) < need:
                continue
            start = rng.randrange(len(ids) - need + 1)
            cases.append(
                {
                    "source": texts[i][0],
                    "start": start,
                    "tokens": length,
                    "context": ids[start : start + length],
                    "continuation": ids[start + length : start + need],
                }
            )
            picked += 1
            if picked == per_length:
                break
        if picked < per_length:
            raise SystemExit(f"error: only {picked} of {per_length} contexts of {need} tokens found in the texts")
    return cases


def continue_from(session, header, continuation: list[int], greedy_n: int):
    """The cache of ``header``, loaded from disk: its logits for ``continuation`` fed in one pass
    (teacher forcing, one row per token) and its ``greedy_n`` greedy tokens after the first one."""
    import torch

    from kvcdn_core import runtime

    cache, _ = runtime.load_cache(session, header, verify_hashes=False)
    greedy_ids, _ = runtime.greedy(session, cache, continuation[:1], greedy_n)
    cache, _ = runtime.load_cache(session, header, verify_hashes=False)
    with torch.inference_mode():
        ids = torch.tensor([continuation], device=session.model.device)
        logits, _ = session.adapter.forward(session.model, ids, cache)
    return logits[0].float().cpu(), greedy_ids


def quality(workdir: Path, session, cases: list[dict], schemes, greedy_n: int = 16) -> dict:
    """Each scheme against the float32 cache of the same context, over every case.

    The context's float32 cache is saved as an artifact and quantized; both are loaded from disk
    and fed the case's continuation. Per step: argmax agreement and KL(float32 || quantized) of the
    next-token distributions, max abs logit difference, and the float32 top-2 margin of a flipped
    step; and whether ``greedy_n`` greedy tokens after the continuation's first token are identical.
    Returns the per-case results and one summary row per scheme and context length.
    """
    from kvcdn_core import artifact, runtime
    from kvcdn_core.exactness.against_prefill import _step_stats

    schemes = installed(schemes)
    results, margins = [], []
    for k, case in enumerate(cases):
        cache, _ = runtime.prefill(session, case["context"], progress=False)
        name = f"{case['source']}@{case['start']}"
        base = runtime.save_cache(session, cache, case["context"], name, workdir / "case.kv")
        ref_logits, ref_ids = continue_from(session, artifact.read_header(base), case["continuation"], greedy_n)
        ref_margins = [float(v[0] - v[1]) for v in ref_logits.topk(2, dim=-1).values]
        margins += ref_margins
        for scheme, params in schemes:
            header = artifact.read_header(quantize_file(base, scheme, params, workdir / "case.q.kv"))
            logits, ids = continue_from(session, header, case["continuation"], greedy_n)
            steps = [_step_stats(a, b) for a, b in zip(ref_logits, logits)]
            kls = [s["kl_divergence"] for s in steps]
            results.append(
                {
                    "case": k,
                    "tokens": case["tokens"],
                    "scheme": label(scheme, params),
                    "agreement": statistics.mean(s["argmax_agree"] for s in steps),
                    "mean_kl": statistics.mean(kls),
                    "max_kl": max(kls),
                    "max_abs_logit_diff": max(s["max_abs_logit_diff"] for s in steps),
                    "largest_flipped_margin": max(
                        (m for m, s in zip(ref_margins, steps) if not s["argmax_agree"]), default=None
                    ),
                    "greedy_identical": ids == ref_ids,
                }
            )
        log(f"  context {k + 1}/{len(cases)} ({name}, {case['tokens']} tokens)")
    return {
        "cases": [{key: c[key] for key in ("source", "start", "tokens")} for c in cases],
        "continuation": len(cases[0]["continuation"]),
        "greedy": greedy_n,
        "steps": len(margins),
        "reference_steps_with_margin_below_0.05": sum(m < 0.05 for m in margins),
        "median_reference_margin": statistics.median(margins),
        "results": results,
        "rows": summarize(results),
    }


def percentile(values, q: int) -> float:
    """The ``q``-th percentile (linear interpolation between the nearest ranks)."""
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(results: list[dict]) -> list[dict]:
    """One row per scheme and context length: the mean over contexts and how far the worst ones fall."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["scheme"], r["tokens"]), []).append(r)
    rows = []
    for (scheme, tokens), group in groups.items():
        agreement = [r["agreement"] for r in group]
        kl = [r["mean_kl"] for r in group]
        flips = [r["largest_flipped_margin"] for r in group if r["largest_flipped_margin"] is not None]
        rows.append(
            {
                "scheme": scheme,
                "tokens": tokens,
                "contexts": len(group),
                "agreement_mean": statistics.mean(agreement),
                "agreement_p5": percentile(agreement, 5),
                "agreement_min": min(agreement),
                "kl_mean": statistics.mean(kl),
                "kl_p95": percentile(kl, 95),
                "kl_max": max(r["max_kl"] for r in group),
                "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in group),
                "largest_flipped_margin": max(flips, default=None),
                "greedy_identical": sum(r["greedy_identical"] for r in group),
            }
        )
    return sorted(rows, key=lambda r: r["tokens"])  # stable: the schemes keep their order


def print_quality(q: dict) -> None:
    """The quality table of :func:`quality` as markdown (what docs/quantization.md shows)."""
    lengths = sorted({c["tokens"] for c in q["cases"]})
    print(
        f"{len(q['cases'])} contexts of {' and '.join(map(str, lengths))} tokens; each scheme against the float32 "
        f"cache, teacher-forced over the next {q['continuation']} tokens of the text ({q['steps']} steps per "
        f"scheme, {q['reference_steps_with_margin_below_0.05']} of them near-ties with a float32 top-2 margin "
        f"< 0.05, median margin {q['median_reference_margin']:.2f}), then {q['greedy']} greedy tokens. "
        "Agreement: share of steps with the same argmax, per context (mean, 5th percentile and minimum over "
        "contexts). KL: mean per context (mean and 95th percentile over contexts), and the largest of one step.\n"
    )
    print(
        "| scheme | context tokens | agreement mean | p5 | min | KL mean | KL p95 | KL max (one step) | "
        "largest margin flipped | greedy identical |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in q["rows"]:
        flipped = "-" if r["largest_flipped_margin"] is None else f"{r['largest_flipped_margin']:.2f}"
        print(
            f"| {r['scheme']} | {r['tokens']} | {100 * r['agreement_mean']:.1f}% | {100 * r['agreement_p5']:.1f}% | "
            f"{100 * r['agreement_min']:.1f}% | {r['kl_mean']:.2e} | {r['kl_p95']:.2e} | {r['kl_max']:.2e} | "
            f"{flipped} | {r['greedy_identical']}/{r['contexts']} |"
        )


def print_cases(q: dict) -> None:
    """The contexts, ``source@start`` (token offset), so that a reader can cut them again."""
    for tokens in sorted({c["tokens"] for c in q["cases"]}):
        names = [f"{c['source']}@{c['start']}" for c in q["cases"] if c["tokens"] == tokens]
        print(f"- {tokens} tokens: " + ", ".join(f"`{n}`" for n in names))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-seconds", type=float, default=180)
    parser.add_argument("--contexts", type=int, default=32)
    parser.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens per context")
    parser.add_argument("--greedy", type=int, default=16, help="greedy tokens per context")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    import torch

    from kvcdn_core import runtime
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
    log("quality against the float32 cache")
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    held_out = [("held-out docstrings", session.tokenizer.eos_token.join(docs[:held]))]
    cases = text_slices(session.tokenizer, held_out, [512], args.contexts, args.continuation)
    report["quality"] = quality(workdir, session, cases, SCHEMES + WITH_RESIDUAL, args.greedy)
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
    print_quality(report["quality"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
