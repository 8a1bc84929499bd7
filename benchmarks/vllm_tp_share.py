"""Bytes a tensor-parallel vLLM engine fetches from the hosted store, with the workers sharing
their fetches (the tier's disk level on: ``kvcdn_vllm.claims``) and without (no disk level: each
worker fetches for itself).

Run with the main environment's Python; the engines run in the vLLM environment through the engine
tests' driver (``plugins/kvcdn-vllm/tests/vllm_driver.py``), each request on a new TP=2 engine (two
worker processes, one core each):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_tp_share.py [--link-mb-per-s 200] [--runs 2]

The model is a Qwen2 built from config (untrained: the bytes and times are the point, not the
tokens) with two KV heads, one per worker, and ``--layers`` layers; a ``--tokens`` document computed
by kvcdn's own runtime is put on a fresh ``kvcdn serve`` by chunks, reached through a link paced to
``--link-mb-per-s`` (``paced_link.py``). Each request is that document and 20 more tokens. The
figures are the workers' own log lines (``kvcdn: request R loaded N tokens of 'doc' (chunks: ...;
B bytes fetched)``), and the request's wall time with ``max_tokens=1``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "plugins" / "kvcdn-vllm" / "tests")]

#: a worker's load of the document: worker, chunks from memory, disk, the store, bytes fetched
LOADED = re.compile(
    r"Worker_TP(\d).*loaded \d+ tokens of 'doc' \(chunks: (\d+) memory, (\d+) disk, (\d+) remote; (\d+) bytes"
)
MODES = {"shared (disk level on)": {}, "each worker for itself (no disk level)": {"tier_disk_bytes": 0}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mb-per-s", type=float, default=200.0)
    parser.add_argument("--runs", type=int, default=2, help="requests of each mode, taken in turn")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    os.environ["KVCDN_TELEMETRY"] = "0"
    for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
        os.environ.pop(name, None)

    from kvcdn_model_qwen import QwenAdapter
    from test_vllm_engine import drive_logged
    from vllm_fleet import paced

    from kvcdn_core import runtime
    from kvcdn_core.model.tiny import build_tiny_model
    from kvcdn_hosted.storage import HostedStorage
    from tests.support import services
    from tests.support.hosted import mint_key

    class TwoHeadQwen(QwenAdapter):
        validation_configs = {
            "Qwen2ForCausalLM": dict(
                hidden_size=512,
                intermediate_size=1024,
                num_hidden_layers=args.layers,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
            )
        }

    work = Path(tempfile.mkdtemp(prefix="kvcdn-tp-share-"))
    model = build_tiny_model(TwoHeadQwen, "Qwen2ForCausalLM", work / "qwen")
    session = runtime.load_session(str(model), device="cpu", dtype="float32")
    rng = random.Random(1)
    document = [rng.randrange(3, 200) for _ in range(args.tokens)]
    runtime.save_cache(session, runtime.prefill(session, document, progress=False)[0], document, "", work / "doc.kv")
    del session
    load_start = os.getloadavg()[0]
    rows: dict[str, list[tuple[float, dict[int, int]]]] = {mode: [] for mode in MODES}
    port = services.free_port()
    with (
        services.kvcdn_server(work / "home", ["--public-url", f"http://127.0.0.1:{port}"]) as server,
        paced(server.url, port, args.link_mb_per_s) as url,
    ):
        os.environ["KVCDN_API_KEY"] = mint_key(server.url, server.admin_secret(), "tp")
        hosted = HostedStorage.from_uri("kvcdn+" + server.url)
        hosted.upload_chunked(work / "doc.kv", "doc")
        hosted.close()
        for i in range(args.runs * len(MODES)):
            mode = list(MODES)[i % len(MODES)]
            connector = {"store": "kvcdn+" + url, "tier_directory": str(work / f"tier{i}"), **MODES[mode]}
            prompt = document + [rng.randrange(3, 200) for _ in range(20)]
            run = {"model": str(model), "connector": connector, "prompts": [prompt], "max_tokens": 1}
            run.update(max_model_len=4096, tensor_parallel_size=2)
            runs, log = drive_logged(work, f"run{i}", [run], timeout=1200)
            fetched = {int(m[0]): int(m[4]) for m in LOADED.findall(log)}
            rows[mode].append((runs[0][0]["seconds"], fetched))
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"TP=2 (2 worker processes), {args.layers} layers, {args.tokens} tokens stored; link "
        f"{args.link_mb_per_s:g} MB/s; OMP_NUM_THREADS={threads}; {os.cpu_count()} CPUs; "
        f"load {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end\n"
    )
    print("| first request of a TP=2 engine | bytes from the store (worker 0 + worker 1), each run | request time |")
    print("|---|---|---|")
    for mode, got in rows.items():
        fetched = " / ".join(" + ".join(f"{f.get(w, 0) / 1e6:.1f}" for w in (0, 1)) + " MB" for _, f in got)
        print(f"| {mode} | {fetched} | {' / '.join(f'{s:.2f}' for s, _ in got)} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
