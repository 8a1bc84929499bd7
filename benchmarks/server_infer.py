"""The hosted `infer` on a resident model and artifact, against a local continue on a loaded session.

The server keeps models and recently used artifact caches resident (kvcdn_server.inference), so a
repeated `infer` should cost what continuing locally costs, plus the private copy of the cache each
request works on. This times, after a discarded warm-up that loads model and artifact:

- ``local``: ``runtime.greedy`` (the question and ``--n`` tokens) on a loaded session and cache;
- ``server``: ``InferenceEngine.run`` for the same artifact, question and ``--n`` (the code behind
  the ``/v1/infer`` route, without HTTP), which forks the resident cache (``ModelAdapter.fork_cache``)
  and runs the same greedy.

The artifact holds a random cache of the model's exact shape (timing does not depend on its
values; benchmarks/cached_ttft.py explains). Qwen3-0.6B shape by default, as the other scripts.

    python benchmarks/server_infer.py --tokens 2048 --n 16 --reps 5 --threads 2 [--model DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cached_ttft import QUESTION, random_artifact  # noqa: E402
from qwen3_shaped import QWEN3_06B, build_model, model_folder  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--n", type=int, default=16, help="tokens to generate per request")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=QWEN3_06B["vocab_size"])
    parser.add_argument("--model", default=None, help="a model directory [default: build the Qwen3-0.6B shape]")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)

    from kvcdn_core import artifact, runtime
    from kvcdn_core.benchmark import set_threads
    from kvcdn_server.inference import InferenceEngine, InferLimits, ModelPolicy

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-server-infer-"))
    model_dir = Path(args.model) if args.model else build_model(model_folder(work, args.vocab), args.vocab)
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    threads = set_threads(args.threads)
    path = random_artifact(session, args.tokens, work / f"server-{args.tokens}.kv")
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    cache, _ = runtime.load_cache(session, artifact.read_header(path))
    limits = InferLimits(slots=1, timeout=3600, max_models=1, cache_bytes=1 << 40, device="cpu", dtype="float32")
    engine = InferenceEngine(ModelPolicy([str(model_dir)]), limits)

    @contextlib.contextmanager
    def fetch_path():
        yield path

    def local():
        twin = copy.deepcopy(cache)  # greedy appends to its cache; copied outside the timing
        start = time.perf_counter()
        tokens, _ = runtime.greedy(session, twin, question, args.n)
        return time.perf_counter() - start, tokens

    def server():
        start = time.perf_counter()
        result = engine.run("bench", ("bench", str(path)), fetch_path, QUESTION, args.n)
        return time.perf_counter() - start, result.tokens

    server()  # warm-up: loads the model and the artifact into the engine
    local()
    times: dict[str, list[float]] = {"local": [], "server": []}
    answers = set()
    for _ in range(args.reps):
        for name, fn in (("local", local), ("server", server)):
            seconds, tokens = fn()
            times[name].append(seconds)
            answers.add(tuple(tokens))
    engine.shutdown()
    med = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{args.tokens} tokens, question {len(question)} tokens + {args.n} generated; threads {threads}; "
        f"{args.reps} reps after a warm-up"
    )
    for name, values in times.items():
        print(f"{name:7s} min {min(values):.3f} s  median {med[name]:.3f} s  max {max(values):.3f} s")
    print(f"server / local: {med['server'] / med['local']:.2f}x (target: at most 1.2x)")
    print(f"same tokens from every request, local and server: {'yes' if len(answers) == 1 else 'NO'}")
    path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
