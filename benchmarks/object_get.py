"""Benchmark the GETs of chunk bodies through signed URLs (what a vLLM engine's remote load is made
of): httpx's streamed body copied into place, against :class:`kvcdn_hosted.objects.ObjectReader`
reading it with ``readinto`` straight into the buffer.

A fresh ``kvcdn serve`` (SQLite, local storage) holds one chunked artifact of ``--tokens`` tokens
whose chunks are about the size of SmolLM2's (``--layers`` full-attention layers of 2 heads of 8
channels: the default 360 make 11.8 MB per 256-token chunk, 94 MB for 2,048 tokens). Its chunks
are fetched ``--reps`` times by each reader, on one thread and on as many as the vLLM tier uses,
into memory already written (as the tier's buffers are). Reported per MB fetched: the medians of
the wall time and of the fetching process's CPU, and the server's CPU over all rounds (the kernel
counts it in ticks of 10 ms).

    OMP_NUM_THREADS=1 python benchmarks/object_get.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def server_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def through_httpx(http):
    """The GET as the hosted backend made it before ObjectReader: httpx's body pieces copied in."""
    from kvcdn_core.store.pack import read_into

    def get(url: str, into: memoryview):
        with http.stream("GET", url) as response:
            assert response.status_code == 200, response.status_code
            return read_into(response.iter_bytes(), into)

    return get


def measure(get, urls: list[tuple[str, int]], streams: int, reps: int, pid: int) -> dict:
    walls, cpus, served = [], [], []
    total = sum(size for _, size in urls)
    for _ in range(reps + 1):  # the first round warms the connections and the server's page cache
        buffers = [memoryview(bytearray(size)) for _, size in urls]
        server0, wall0, cpu0 = server_cpu_s(pid), time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(streams) as pool:
            got = list(pool.map(lambda ub: get(ub[0][0], ub[1]), zip(urls, buffers)))
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
        served.append(server_cpu_s(pid) - server0)
        assert all(g is b for g, b in zip(got, buffers))
    mb = total / 1e6
    return {
        "mb": mb,
        "wall_ms_per_mb": statistics.median(walls[1:]) * 1000 / mb,
        "client_cpu_ms_per_mb": statistics.median(cpus[1:]) * 1000 / mb,
        "server_cpu_ms_per_mb": sum(served[1:]) * 1000 / (mb * reps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=360)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)

    from kvcdn_vllm import lookup
    from kvcdn_vllm.tier import FETCH_STREAMS

    from kvcdn_core import artifact
    from kvcdn_hosted.storage import HostedStorage
    from tests.support import services
    from tests.support.hosted import mint_key
    from tests.support.storefiles import write_kinds

    with tempfile.TemporaryDirectory() as t, services.kvcdn_server(Path(t) / "home") as server:
        os.environ["KVCDN_TELEMETRY"] = "0"
        os.environ["KVCDN_API_KEY"] = mint_key(server.url, server.admin_secret(), "bench")
        storage = HostedStorage.from_uri("kvcdn+" + server.url)
        path = Path(t) / "doc.kv"
        model = {"id": "example/bench", "architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64}
        tensors = write_kinds(path, ["full_attention"] * args.layers, args.tokens, seed=1, model=model)
        storage.upload_chunked(path, "doc")
        finder = lookup.open_lookup("kvcdn+" + server.url, lookup.engine_root(model, "float32"), print)
        match = finder.lookup(tensors[artifact.TOKEN_IDS].tolist() + [1])
        assert match is not None, "the lookup found no match for the artifact just stored"
        plan = lookup.plan(match.record, 0, args.tokens, match.locations)
        urls = [(dict(plan.locations)[p.digest], p.bytes) for p in plan.parts]
        pid = server.process.pid
        readers = {"httpx": through_httpx(storage.client.http), "ObjectReader": storage.client.objects.get}
        rows = []
        for streams in (1, FETCH_STREAMS):
            for name, get in readers.items():
                rows.append((name, streams, measure(get, urls, streams, args.reps, pid)))
        storage.close()

    mb = rows[0][2]["mb"]
    print(f"{len(urls)} chunks, {mb:.1f} MB; median of {args.reps}; threads: 1 torch, the fetch streams as shown")
    print("| reader | streams | wall ms/MB | client CPU ms/MB | server CPU ms/MB | MB/s |")
    print("|---|---|---|---|---|---|")
    for name, streams, r in rows:
        print(
            f"| {name} | {streams} | {r['wall_ms_per_mb']:.3f} | {r['client_cpu_ms_per_mb']:.3f} | "
            f"{r['server_cpu_ms_per_mb']:.3f} | {1000 / r['wall_ms_per_mb']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
