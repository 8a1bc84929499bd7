"""Benchmark the chunk store's bytes: what `kvcdn store` keeps against today's layout (whole `.kv` files).

Two workloads, built the way real use builds them, on a small Qwen3-shaped model made from config
(random weights, float32, CPU): every artifact is a real prefill, and each one that continues
another was prefilled *on that artifact's loaded cache*, so the bytes of a shared prefix are equal.

(a) RAG: one 2,048-token prefix (a system prompt and documents) prefilled once and saved; 50
    prompts, each the prefix's cache loaded and its own 512-token suffix prefilled on it, saved.
    Stored bytes against the bytes of the unique chunks (every distinct object once, the ideal of a
    content-addressed store) and against 50 whole `.kv` files.
(b) Chat: a 20-turn conversation (turns of 100-300 tokens), every turn saved as an artifact after
    continuing from the previous turn's. Stored bytes against the final conversation's own `.kv`
    size and against 20 whole files, with and without chunk pieces (a turn's chunk built on the
    previous turn's stored partial chunk, which is a token-prefix of it), and on the hosted service:
    every turn put to a fresh ``kvcdn serve`` (SQLite, local storage) through ``kvcdn store put
    --store kvcdn://``'s code, its bytes read from the server's chunk objects and records.

    OMP_NUM_THREADS=1 python benchmarks/store_bench.py [--rag 50] [--turns 20] [--seed 0] [--no-hosted]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: the model: 4 layers, 2 key-value heads of width 32, float32: 2 KiB of cache per token
MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)


def build_model(out: Path) -> Path:
    import torch

    from kvcdn_core.model.tiny import model_class, train_tokenizer

    tok = train_tokenizer()
    cls = model_class("Qwen3ForCausalLM")
    config = cls.config_class(
        vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    cls(config).to(torch.float32).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def text_ids(session, rng: random.Random, n: int) -> list[int]:
    """``n`` token ids of text (sentences of the sample text in a random order)."""
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    sentences = [s.strip() + "." for s in SAMPLE_TEXT.replace("\n", " ").split(".") if s.strip()]
    ids: list[int] = []
    while len(ids) < n:
        ids += session.adapter.encode_continuation(session.tokenizer, " " + " ".join(rng.sample(sentences, 4)))
    return ids[:n]


def save(session, cache, ids, path: Path) -> Path:
    from kvcdn_core import runtime

    return runtime.save_cache(session, cache, ids, runtime.decode(session, ids), path)


def continued(session, parent: Path | None, ids: list[int], new: list[int], path: Path) -> Path:
    """The artifact of ``ids + new``: ``parent``'s cache loaded (or a new one) and ``new`` prefilled on it."""
    from kvcdn_core import artifact, runtime

    cache = runtime.load_cache(session, artifact.read_header(parent))[0] if parent else None
    cache, _ = runtime.prefill(session, new, chunk=256, progress=False, cache=cache)
    return save(session, cache, ids + new, path)


def store_bytes(store) -> dict:
    from kvcdn_core.store.chunkstore import ARTIFACTS, CHUNKS

    chunks = sum(o.size for o in store.backend.list(CHUNKS))
    records = sum(o.size for o in store.backend.list(ARTIFACTS))
    return {"chunk_bytes": chunks, "record_bytes": records, "stored": chunks + records}


def put_all(paths: list[Path], root: Path):
    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store.chunkstore import ChunkStore

    store = ChunkStore(LocalStorage(root))
    start = time.perf_counter()
    reports = [store.put(p, p.stem) for p in paths]
    return store, reports, time.perf_counter() - start


def mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def rag(session, work: Path, n: int, rng: random.Random) -> None:
    prefix_ids = text_ids(session, rng, 2048)
    prefix = continued(session, None, [], prefix_ids, work / "prefix.kv")
    paths = []
    for i in range(n):
        paths.append(continued(session, prefix, prefix_ids, text_ids(session, rng, 512), work / f"rag{i:02d}.kv"))
    store, reports, seconds = put_all(paths, work / "store-rag")
    b = store_bytes(store)
    today = sum(p.stat().st_size for p in paths)
    per_token = store.record(paths[0].stem).chunks[0].bytes // 256
    unique_tokens = 2048 + 512 * n
    shared = [r.chunks_shared for r in reports[1:]]
    print(f"\n(a) {n} artifacts of 2,048 shared + 512 own tokens ({per_token:,} bytes of cache per token)")
    print(f"    chunks shared by each put after the first: {min(shared)}-{max(shared)} of {reports[0].chunks}")
    rows = [
        ("today: whole .kv files", today),
        ("chunk store: stored (chunks + records)", b["stored"]),
        ("  of which chunks and tails (unique objects)", b["chunk_bytes"]),
        ("  of which records (headers, chunk lists)", b["record_bytes"]),
        ("ideal: cache of the unique tokens", per_token * unique_tokens),
    ]
    for label, value in rows:
        print(f"    {label:<46} {mb(value):>12}")
    print(f"    stored / unique chunks' bytes          {b['stored'] / b['chunk_bytes']:.3f}x  (goal <= 1.1x)")
    print(f"    stored / ideal unique tokens' cache    {b['stored'] / (per_token * unique_tokens):.3f}x")
    print(f"    today / stored                         {today / b['stored']:.1f}x")
    print(
        f"    put of {n} artifacts: {seconds:.1f} s, moved {mb(sum(r.bytes_moved for r in reports))}, "
        f"saved {mb(sum(r.bytes_saved for r in reports))}"
    )


def hosted_chat(paths: list[Path], work: Path):
    """Every turn put to a fresh ``kvcdn serve`` through the hosted chunk store; its records and the
    bytes it keeps (chunk objects on disk, records in its database)."""
    import os
    import sqlite3

    from kvcdn_hosted.storage import HostedStorage
    from tests.support import services
    from tests.support.hosted import mint_key

    home = work / "server-home"
    env = {"KVCDN_TELEMETRY": "0", "KVCDN_QUOTA_STORAGE_BYTES": str(1 << 40), "KVCDN_QUOTA_ARTIFACTS": "10000"}
    for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
        os.environ.pop(name, None)
    with services.kvcdn_server(home, env=env) as server:
        os.environ["KVCDN_API_KEY"] = mint_key(server.url, server.admin_secret(), "chat")
        hosted = HostedStorage.from_uri("kvcdn+" + server.url)
        store = hosted.chunk_store()
        reports = [store.put(p, p.stem) for p in paths]
        records = [store.record(p.stem) for p in paths]
        hosted.close()
        chunk_bytes = sum(f.stat().st_size for f in (server.data_dir / "objects" / "chunks").iterdir())
        with sqlite3.connect(server.data_dir / "kvcdn.db") as db:
            rows = db.execute("SELECT record FROM artifacts WHERE status = 'ready'").fetchall()
        record_bytes = sum(len(r[0].encode()) for r in rows)
    stored = {"chunk_bytes": chunk_bytes, "record_bytes": record_bytes, "stored": chunk_bytes + record_bytes}
    return stored, records, reports


def chat(session, work: Path, turns: int, rng: random.Random, hosted: bool = True) -> None:
    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store.chunkstore import ChunkStore

    ids: list[int] = []
    parent = None
    paths = []
    for t in range(turns):
        new = text_ids(session, rng, rng.randint(100, 300))
        parent = continued(session, parent, ids, new, work / f"turn{t:02d}.kv")
        ids += new
        paths.append(parent)
    final = paths[-1].stat().st_size
    today = sum(p.stat().st_size for p in paths)
    print(f"\n(b) a {turns}-turn conversation, every turn saved ({len(ids):,} tokens at the end)")
    print("    final: the chunks and pieces the final turn references; others: the objects it does not")
    print("    (other turns' partial last chunks); tails: every turn's tail (its token ids)")
    print(
        f"    {'layout':<22} {'stored':>12} {'/ final':>8} {'final':>10} {'others':>10} {'tails':>10} {'records':>10}"
    )
    print(f"    {'today: whole files':<22} {mb(today):>12} {today / final:>7.2f}x")
    layouts = [("256-token chunks", False), ("256, with pieces", True)] + ([("hosted service", None)] if hosted else [])
    for label, pieces in layouts:
        if pieces is None:
            b, records, reports = hosted_chat(paths, work)
        else:
            store = ChunkStore(LocalStorage(work / f"store-chat-{pieces}"), pieces=pieces)
            reports = [store.put(p, p.stem) for p in paths]
            b = store_bytes(store)
            records = [store.record(p.stem) for p in paths]
        tails = sum(r.tail.bytes for r in records if r.tail)
        objects = {p.digest: p.bytes for r in records for c in r.chunks for p in c.parts}
        mine = {p.digest for c in records[-1].chunks for p in c.parts}
        others = sum(size for d, size in objects.items() if d not in mine)
        print(
            f"    {label:<22} {mb(b['stored']):>12} {b['stored'] / final:>7.2f}x {mb(b['chunk_bytes'] - tails - others):>10} "
            f"{mb(others):>10} {mb(tails):>10} {mb(b['record_bytes']):>10}"
        )
        pieced = sum(r.chunks_pieced for r in reports)
        if pieces is not False:
            print(f"      ({label}: the {turns} records hold {pieced} chunk(s) made of pieces)")
    print(f"    final conversation's own .kv: {mb(final)}; goal: stored <= 1.3x of it")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rag", type=int, default=50, help="artifacts sharing the 2,048-token prefix")
    parser.add_argument("--turns", type=int, default=20, help="turns of the conversation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-hosted", dest="hosted", action="store_false", help="leave out the hosted service's row of (b)"
    )
    args = parser.parse_args(argv)
    from kvcdn_core import runtime

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvcdn-store-bench-") as tmp:
        work = Path(tmp)
        model = build_model(work / "model")
        session = runtime.load_session(str(model), device="cpu", dtype="float32")
        rag(session, work, args.rag, rng)
        chat(session, work, args.turns, rng, args.hosted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
