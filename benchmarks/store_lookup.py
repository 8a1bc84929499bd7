"""The vLLM connector's per-request lookup on a chunk store (a local directory), timed.

One synthetic artifact of ``--layers`` full-attention layers and ``--tokens`` tokens is put into a
fresh store; then ``--lookups`` prompts (its tokens and three more) go through the scheduler-side
lookup (:class:`kvcdn_vllm.lookup.StoreLookup`: the prefix index, then the hit's record), each
way in turn: with the store keeping the records it parsed (``KEPT_RECORDS``, as it runs) and with
none kept (every lookup parses the record: its ``.kv`` header, checked against its chunk plan).
The record's size grows with the layers: 30 is SmolLM2's count. Wall times, p50, one thread.

    OMP_NUM_THREADS=1 python benchmarks/store_lookup.py [--layers 30] [--tokens 2048] [--lookups 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FINGERPRINT = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": None}


def p50_ms(finder, prompt: list[int], lookups: int, tokens: int) -> float:
    times = []
    for _ in range(lookups):
        began = time.perf_counter()
        match = finder.lookup(prompt)
        times.append((time.perf_counter() - began) * 1000)
        assert match is not None and match.prefix_tokens == tokens
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--lookups", type=int, default=200)
    args = parser.parse_args(argv)

    from kvcdn_vllm import lookup

    from kvcdn_core import artifact
    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store import chunkstore
    from kvcdn_core.store.chunkstore import ChunkStore, record_key
    from tests.support.storefiles import write_kinds

    with tempfile.TemporaryDirectory(prefix="kvcdn-store-lookup-") as tmp:
        store = ChunkStore(LocalStorage(Path(tmp) / "store"))
        tensors = write_kinds(Path(tmp) / "a.kv", ["full_attention"] * args.layers, args.tokens)
        store.put(Path(tmp) / "a.kv", "doc")
        record_bytes = len(store.backend.read_bytes(record_key("doc")) or b"")
        prompt = tensors[artifact.TOKEN_IDS].tolist() + [5, 6, 7]
        finder = lookup.StoreLookup(store, lookup.engine_root(FINGERPRINT, "float32"), print)
        finder.warm()
        kept = chunkstore.KEPT_RECORDS
        rows = []
        # none kept first, while the store holds no parsed record from the other way
        for label, keep in (("none kept: parsed at every lookup", 0), ("records kept", kept)):
            chunkstore.KEPT_RECORDS = keep
            rows.append((label, p50_ms(finder, prompt, args.lookups, args.tokens)))
        chunkstore.KEPT_RECORDS = kept
    print(
        f"{args.layers} layers, {args.tokens} tokens: a record of {record_bytes:,} bytes; {args.lookups} lookups each"
    )
    print("| store | lookup p50 |")
    print("|---|---|")
    for label, ms in rows:
        print(f"| {label} | {ms:.3f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
