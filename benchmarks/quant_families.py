"""Is each quantization scheme token-exact on every installed family's tiny config, once the model
has learned something? (The numbers quoted in docs/quantization.md, "Exactness".)

Random-weight tiny models decode through near-ties that any lossy cache may flip, so each tiny
config is first taught kvcdn's sample text (a few seconds of training; models with a short position
limit train on windows of it). Then the first three paragraphs are cached, quantized with each
scheme, and the continuation of the fourth paragraph's opening is compared by token id with a full
prefill (``kvcdn_core.exactness.against_prefill.run_verify``, the path of ``kvcdn quant --verify``).

    OMP_NUM_THREADS=1 python benchmarks/quant_families.py [--schemes int8,int8-tensor,fp8] [ARCH ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = "Engineers who run retrieval services"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("architectures", nargs="*", help="default: every installed architecture")
    parser.add_argument("--schemes", default="int8,int8-tensor,fp8")
    parser.add_argument("--n", type=int, default=16)
    args = parser.parse_args(argv)

    from kvcdn_core import artifact, runtime
    from kvcdn_core.contracts.adapter import quiet_transformers
    from kvcdn_core.exactness.against_prefill import run_verify
    from kvcdn_core.model.tiny import SAMPLE_TEXT, build_tiny_model, teach_tiny_model
    from kvcdn_core.plugin_host.registry import adapter_classes, quantizer_for
    from kvcdn_core.quant import codec

    quiet_transformers()
    schemes = args.schemes.split(",")
    context = "\n\n".join(SAMPLE_TEXT.split("\n\n")[:3]) + "\n\n"
    adapters = adapter_classes()
    exact = {s: 0 for s in schemes}
    done = 0
    print("| architecture | training loss | layers quantized (int8) | " + " | ".join(schemes) + " |")
    print("|---|---:|---:|" + "---:|" * len(schemes))
    for arch in args.architectures or sorted(adapters):
        work = Path(tempfile.mkdtemp(prefix="kvcdn-qf-"))
        start = time.perf_counter()
        try:
            loss = teach_tiny_model(
                build_tiny_model(adapters[arch], arch, work / "random"), work / "taught", SAMPLE_TEXT
            )
            session = runtime.load_session(
                str(work / "taught"), device="cpu", dtype="float32", adapter_cls=adapters[arch]
            )
            src = work / "ctx.kv"
            runtime.generate(session, context, src, progress=False)
            header = artifact.read_header(src)
            tensors = artifact.load_tensors(header)
            cells, quantized = [], "-"
            for scheme in schemes:
                result = codec.quantize_cache(header.manifest, tensors, quantizer_for(scheme)())
                out = artifact.write_artifact(work / f"ctx.{scheme}.kv", result.manifest, result.tensors)
                res = run_verify(session, artifact.read_header(out), QUESTION, args.n)
                exact[scheme] += res.passed
                cells.append(f"{res.matches}/{res.n}")
                if scheme == "int8":
                    quantized = f"{result.quantized_layers}/{len(header.manifest['layers'])}"
            done += 1
            print(f"| {arch} | {loss:.3f} | {quantized} | " + " | ".join(cells) + " |", flush=True)
        except Exception as exc:  # one family's failure is a row, not the end of the table
            print(f"| {arch} | error: {type(exc).__name__}: {str(exc)[:120]} |", flush=True)
        print(f"  ({time.perf_counter() - start:.1f}s)", file=sys.stderr, flush=True)
    print("\nexact continuations: " + ", ".join(f"{s} {exact[s]}/{done}" for s in schemes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
