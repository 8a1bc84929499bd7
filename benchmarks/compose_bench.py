"""Composing cached documents out of prefix order: quality and time-to-first-token on real weights.

SmolLM2-135M-Instruct (converted offline, kvcdn_core/testing/smollm2.py), float32 on CPU. The
documents are docstrings of the standard library's own modules (prose any Python install carries:
no download), cut to a random length of 256-512 tokens; each is generated once into an artifact.
Each of ``--prompts`` RAG prompts takes ``--docs`` of them in a random order (seeded), then a
question. For every ``--recompute`` share and selection rule, the composition is compared with the
full prefill of the same token ids: the reference's ``--greedy`` greedy tokens are fed to both
(teacher forcing), per step argmax agreement, KL(full || composed) and top-5 overlap; "greedy
identical" counts prompts where every step agrees (then a free greedy decode of the composition is
the reference's, token for token). TTFT: from artifacts on disk (page cache warm) to the first
token's logits, against a full prefill and against prefix-only reuse (the first artifact loaded,
the rest prefilled). It prints the table of docs/compose.md; a measurement, not a test.

    python benchmarks/compose_bench.py [--prompts 32] [--recompute 0,0.05,0.15,0.3,1] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_report  # noqa: E402  (the standard-library corpus, shared with the quantization benchmark)

QUESTIONS = [
    "\n\nQuestion: Which of the passages above describes a class, and what is it for?\nAnswer:",
    "\n\nQuestion: Summarize the second passage in one sentence.\nAnswer:",
    "\n\nQuestion: What do the passages above have in common?\nAnswer:",
    "\n\nQuestion: Name one function mentioned above and say what it returns.\nAnswer:",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_documents(session, workdir: Path, count: int, seed: int):
    """``count`` artifacts of docstrings cut to 256-512 tokens: ``[(path, name)]``."""
    from kvcdn_core import runtime

    rng = random.Random(seed)
    pool = [d for d in quant_report.stdlib_docstrings() if len(d) > 1500]
    rng.shuffle(pool)
    made = []
    for text in pool:
        ids = session.adapter.encode_context(session.tokenizer, text)
        if len(ids) < 256:
            continue
        ids = ids[: rng.randint(256, 512)]
        cache, _ = runtime.prefill(session, ids, progress=False)
        path = workdir / f"doc{len(made):02d}.kv"
        runtime.save_cache(session, cache, ids, runtime.decode(session, ids), path)
        made.append(path)
        if len(made) == count:
            return made
    raise SystemExit(f"only {len(made)} docstrings of 256+ tokens")


def step_stats(ref_ids, ref_logits, logits) -> dict:
    import torch

    agree, kls, top5 = 0, [], []
    for token, a, b in zip(ref_ids, ref_logits, logits):
        agree += int(b.argmax()) == token
        pa, pb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
        kls.append(max(float((pa.exp() * (pa - pb)).sum()), 0.0))
        top5.append(len(set(a.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist())) / 5)
    n = len(ref_ids)
    return {"agreement": agree / n, "kl": statistics.mean(kls), "top5": statistics.mean(top5), "identical": agree == n}


def first_logits(session, cache, question_ids):
    """The question fed on a context's cache: ``(logits of its last token, cache)``, the first token's."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([question_ids], device=session.device)
        return session.adapter.last_logits(session.model, ids, cache)


def run_prompt(session, headers, question_ids, shares, rules, greedy: int, time_prefix: bool) -> dict:
    from kvcdn_core import compose, runtime

    parts = compose.load_parts(session, headers)
    ids = [i for _, part in parts for i in part]
    t0 = time.perf_counter()
    cache, _ = runtime.prefill(session, ids, progress=False)
    logits, cache = first_logits(session, cache, question_ids)
    full_s = time.perf_counter() - t0
    ref_ids, ref_logits = runtime.decode_from(session, cache, logits, greedy)
    prefix_s = None
    if time_prefix:
        t0 = time.perf_counter()
        first, _ = runtime.load_cache(session, headers[0])
        cache, _ = runtime.prefill(session, ids[len(parts[0][1]) :], cache=first, progress=False)
        first_logits(session, cache, question_ids)
        prefix_s = time.perf_counter() - t0
    rows = []
    for share in shares:
        for rule in rules if 0 < share < 1 else rules[:1]:
            t0 = time.perf_counter()
            composed = compose.compose(session, headers, share, rule)  # loaded from disk, as a user runs it
            logits, cache = first_logits(session, composed.cache, question_ids)
            ttft = time.perf_counter() - t0
            _, logits = runtime.decode_from(session, cache, logits, greedy, forced=ref_ids)
            stats = step_stats(ref_ids, ref_logits, logits)
            rows.append({"recompute": share, "rule": rule if 0 < share < 1 else "-", "ttft_s": ttft, **stats})
    return {"tokens": len(ids), "full_s": full_s, "prefix_s": prefix_s, "rows": rows}


def summarize(prompts: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for p in prompts:
        for r in p["rows"]:
            groups.setdefault((r["recompute"], r["rule"]), []).append(
                {**r, "full_s": p["full_s"], "prefix_s": p["prefix_s"]}
            )
    out = []
    for (share, rule), rows in groups.items():
        agreement = [r["agreement"] for r in rows]
        out.append(
            {
                "recompute": share,
                "rule": rule,
                "agreement_mean": statistics.mean(agreement),
                "agreement_min": min(agreement),
                "kl_mean": statistics.mean(r["kl"] for r in rows),
                "kl_max": max(r["kl"] for r in rows),
                "top5_mean": statistics.mean(r["top5"] for r in rows),
                "identical": sum(r["identical"] for r in rows),
                "prompts": len(rows),
                "speedup_vs_full": statistics.median(r["full_s"] / r["ttft_s"] for r in rows),
                "speedup_vs_prefix": statistics.median(
                    r["prefix_s"] / r["ttft_s"] for r in rows if r["prefix_s"] is not None
                ),
            }
        )
    return out


def print_table(report: dict) -> None:
    print(
        f"{report['prompts']} prompts of {report['docs']} documents (256-512 tokens each, "
        f"{report['tokens_min']}-{report['tokens_max']} context tokens), SmolLM2-135M-Instruct float32, CPU, "
        f"{report['threads']} torch thread(s), seed {report['seed']}, prefix reuse timed on every "
        f"{report['prefix_every']}th prompt; teacher-forced over the full prefill's "
        f"{report['greedy']} greedy tokens.\n"
    )
    print(
        "| recompute | rule | agreement mean (min) | KL mean (max) | top-5 overlap | greedy identical | TTFT vs full | TTFT vs prefix reuse |"
    )
    print("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in report["summary"]:
        print(
            f"| {r['recompute']:g} | {r['rule']} | {r['agreement_mean']:.1%} ({r['agreement_min']:.0%}) | "
            f"{r['kl_mean']:.3f} ({r['kl_max']:.3f}) | {r['top5_mean']:.2f} | {r['identical']}/{r['prompts']} | "
            f"{r['speedup_vs_full']:.2f}x | {r['speedup_vs_prefix']:.2f}x |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--docs", type=int, default=4, help="documents per prompt")
    parser.add_argument("--pool", type=int, default=24, help="distinct documents the prompts draw from")
    parser.add_argument(
        "--recompute", default="0,0.05,0.15,0.3", help="shares, comma-separated (1 is the full prefill: tested exact)"
    )
    parser.add_argument("--rules", default="deviation,doc-start")
    parser.add_argument("--greedy", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--prefix-every", type=int, default=4, help="time prefix-only reuse on every k-th prompt (it costs a prefill)"
    )
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--jsonl", default=None, help="append each prompt's result to this file as it is measured")
    parser.add_argument("--table-from", default=None, help="print the table of a --jsonl file and exit")
    args = parser.parse_args(argv)
    if args.table_from:
        lines = Path(args.table_from).read_text().splitlines()
        print_table(report_of([json.loads(line) for line in lines], args))
        return 0
    import torch

    from kvcdn_core import artifact, runtime
    from kvcdn_core.contracts.adapter import quiet_transformers
    from kvcdn_core.testing.smollm2 import smollm2_dir

    torch.set_num_threads(args.threads)
    quiet_transformers()
    shares = [float(x) for x in args.recompute.split(",")]
    rules = args.rules.split(",")
    session = runtime.load_session(str(smollm2_dir()), device="cpu", dtype="float32")
    rng = random.Random(args.seed)
    prompts = []
    with tempfile.TemporaryDirectory(prefix="kvcdn-compose-bench-") as tmp:
        paths = make_documents(session, Path(tmp), args.pool, args.seed)
        log(f"{len(paths)} documents generated")
        for i in range(args.prompts):
            chosen = rng.sample(paths, args.docs)
            question = rng.choice(QUESTIONS)
            headers = [artifact.read_header(p) for p in chosen]
            q_ids = session.adapter.encode_continuation(session.tokenizer, question)
            timed = i % args.prefix_every == 0
            result = run_prompt(session, headers, q_ids, shares, rules, args.greedy, timed)
            result["documents"] = [p.name for p in chosen]
            prompts.append(result)
            if args.jsonl:  # one line per prompt: a partial run still gives its table (--table-from)
                with open(args.jsonl, "a") as out:
                    out.write(json.dumps(result) + "\n")
            log(f"prompt {i + 1}/{args.prompts}: {result['tokens']} tokens, full {result['full_s']:.2f}s")
    report = report_of(prompts, args)
    print_table(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def report_of(prompts: list[dict], args) -> dict:
    return {
        "prompts": len(prompts),
        "docs": args.docs,
        "greedy": args.greedy,
        "seed": args.seed,
        "threads": args.threads,
        "prefix_every": args.prefix_every,
        "tokens_min": min(p["tokens"] for p in prompts),
        "tokens_max": max(p["tokens"] for p in prompts),
        "summary": summarize(prompts),
        "per_prompt": prompts,
    }


if __name__ == "__main__":
    sys.exit(main())
