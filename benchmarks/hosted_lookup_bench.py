"""Benchmark the hosted prefix lookup (``POST /api/v1/prefix/lookup``) over loopback HTTP.

For each size, a fresh ``kvcdn serve`` (SQLite, local storage) whose index holds ``n`` synthetic
artifacts of ``--tokens`` tokens shaped like ``search_bench.py --store-index``'s corpus (documents,
and variants of each sharing a prefix of every length). The rows are inserted directly through
:func:`kvcdn_server.prefix.index_artifacts` (what a confirm calls for one artifact), 500 artifacts
to a transaction, not through uploads: 10,000 real uploads take hours here. Then 200 queries (a
random artifact's prefix of random length, then 200 new tokens) through the hosted client's own lookup (:meth:`HostedStorage.prefix_lookup`: one
request of chain keys, a second only when the answer was incomplete, refined to the token), timed
end to end: p50 and p99.
"Index bytes per artifact" is the database's growth from the index rows, divided by ``n``.

    OMP_NUM_THREADS=1 python benchmarks/hosted_lookup_bench.py --sizes 1000,10000,100000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def corpus(n: int, tokens: int, seed: int):
    """``art(i)``: (name, token ids) of artifact ``i`` of ``n``, made on demand (100,000 of them would
    not fit in memory at once), and 200 queries, as ``search_bench.synthetic_state``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    variants = 10
    docs = rng.integers(0, 151_936, size=(max(1, n // variants), tokens), dtype=np.int64)

    def art(i: int):
        d, j = i % len(docs), i // len(docs)
        keep = tokens * j // variants if j else tokens
        return f"d{d:05d}/v{j:02d}", np.concatenate([docs[d][:keep], docs[(d + 1) % len(docs)][keep:]])

    queries = []
    for _ in range(200):
        _, body = art(int(rng.integers(n)))
        cut = int(rng.integers(1, tokens + 1))
        queries.append(np.concatenate([body[:cut], rng.integers(0, 151_936, size=200)]))
    return art, queries


def db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def run(n: int, tokens: int, seed: int) -> str:
    import uuid

    import numpy as np

    from kvcdn_core.store import keys
    from kvcdn_hosted.config import load_settings
    from kvcdn_hosted.storage import HostedStorage
    from kvcdn_server import prefix
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.config import load_config
    from kvcdn_server.db import open_database
    from tests.support.services import kvcdn_server

    fp = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}
    root = keys.root_key(fp, keys.representation("bfloat16", None))
    with tempfile.TemporaryDirectory(prefix="kvcdn-hosted-bench-") as tmp:
        home = Path(tmp)
        env = {"KVCDN_API_KEY_ORGS": "bench", "XDG_DATA_HOME": str(home)}
        os.environ.update(env)
        config = load_config()
        db_file = Path(config.database_url.split(":///", 1)[1])
        engine = open_database(config.database_url)  # migrated: the server finds the schema in place
        before = db_bytes(db_file)
        art, queries = corpus(n, tokens, seed)
        start = time.perf_counter()
        for first in range(0, n, 500):  # bulk: 500 artifacts a transaction, a few statements each
            batch = []
            for i in range(first, min(n, first + 500)):
                name, ids = art(i)
                entry = prefix.entry_from_ids(root, "any_prefix", ids, dict(fp, id="bench"), "bfloat16", None)
                batch.append((str(uuid.uuid4()), "org:bench", name, entry))
            with engine.begin() as c:
                prefix.index_artifacts(c, batch)
        build_s = time.perf_counter() - start
        engine.dispose()
        per_artifact = (db_bytes(db_file) - before) / n
        key = derive_key(config.api_key_seed, "bench")
        with kvcdn_server(home, [], {**env, "KVCDN_TELEMETRY": "0"}) as server:
            os.environ.update(KVCDN_API_URL=server.url, KVCDN_API_KEY=key, KVCDN_TELEMETRY="0")
            store = HostedStorage(load_settings())
            for q in queries[:10]:  # warm the connection and the database's pages
                store.prefix_lookup(root, q, 0, 10)
            times, exact = [], 0
            for q in queries:
                t0 = time.perf_counter()
                hits = store.prefix_lookup(root, q, 0, 10)
                times.append(time.perf_counter() - t0)
                exact += bool(hits) and hits[0].prefix_tokens >= 1
            store.close()
        p50, p99 = np.percentile(times, 50) * 1e3, np.percentile(times, 99) * 1e3
        return (
            f"| {n:,} x {tokens:,} | {build_s:.1f} s | {per_artifact / 1e3:.1f} kB | {p50:.1f} ms | {p99:.1f} ms "
            f"| {exact}/{len(queries)} |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("| artifacts x tokens | index rows inserted | index bytes / artifact | lookup p50 | lookup p99 | found |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        print(run(n, args.tokens, args.seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
