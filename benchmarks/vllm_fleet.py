"""A fleet's kvcdn store in vLLM, in one run: what is fetched, what the lookup costs, first-token times
side by side, and what saving a conversation stores and costs.

Run with the vLLM environment's Python (``scripts/vllm-venv.sh`` builds ``.venv-vllm``); the hosted
service is started with ``--kvcdn`` (default: ``kvcdn`` on PATH, the main environment's, which has
the server):

    OMP_NUM_THREADS=2 .venv-vllm/bin/python benchmarks/vllm_fleet.py [--artifacts 1000] [--format json]

The stores: a fresh ``kvcdn serve`` (SQLite, local storage) and a local chunk-store directory, each
holding ``--artifacts`` synthetic artifacts of SmolLM2's fingerprint (512 random tokens, two small
layers: they fill the same prefix index the prompt is looked up in) and one real SmolLM2 artifact:
a 2,048-token document and a question, computed by kvcdn's own runtime. The prompt is that
document and another question, so it shares exactly the 2,048-token prefix.

Engines run one after another in this process (engine core and worker in-process, ``--threads``
torch threads), float32 and eager; each first serves a short unrelated prompt so that no
measurement pays the engine's first forward pass. TTFT is the wall time of one request with
``max_tokens=1``; ``--reps`` requests where it says "later". Each request also has its CPU time
(:class:`CpuMeter`): this process's (every thread), the hosted server's while it runs, and the
machine's cores busy over the request (busy time / wall time, from ``/proc/stat``).

1. vLLM alone, its prefix cache on: the prompt cold, then again (the prefix-cache hit, the floor);
   then the conversation of figure 3 with no connector.
2. kvcdn, store = the hosted service, an empty tier: the prompt (every chunk from the store), then
   again (``--reps``, from the memory tier). Every HTTP response body this process receives while a
   request runs is counted, so "nothing else downloaded" is measured, not assumed.
3. The same store and tier directory, a new engine: the first request takes the chunks from the disk
   tier (checked once, as a file this engine has not read), later ones from memory.
4. kvcdn, store = the local directory, an empty tier (chunks from the store directory).
5. vLLM's ``ExampleConnector``: one request stores its files, later ones load them.
6. kvcdn, store = a new local directory, ``save`` on, prefix cache on: the conversation of
   ``--turns`` turns (each turn a user message and a fixed reply of about ``--turn-tokens`` tokens
   in all), one request per turn. Stored bytes are the store directory's size after the engine
   shut down (its saves finished), against the final conversation's own artifact bytes.

The scheduler's lookup is also timed outside the engines: ``--lookups`` lookups of the prompt
through the connector's own lookup object, p50 and p99; and the link's speed, as the prefix's
chunks fetched once through that object's own source. ``--profile`` runs the kvcdn requests
and the last saved turn under cProfile (saves run in a process of their own) and prints where their time goes (the timings then include
the profiler's overhead: use it for shares, not for the table). ``--conversation-only`` runs only figure 3
(the conversation without a connector, then with ``save`` on): no stores, no server, about 2 minutes.

``--link-mb-per-s N`` puts the engines' hosted store behind a link of N MB/s (``paced_link.py``: a
proxy that paces every answer through one shared schedule; the server's ``--public-url`` names it,
so the signed chunk URLs go through it too): on loopback the fetch is CPU time of the same two
cores the forward runs on, where a fleet's store sits across a network that bounds it instead.
The hosted rows, the hosted lookups and the hosted link's speed then go through the proxy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vllm_engines import close, dir_bytes, document_ids, engine, kvcdn, ttft  # noqa: E402

QUESTION_STORED = " Question: what did the keeper write by candlelight?"
QUESTION_ASKED = "\n\nSummarize the paragraph above in one sentence, please."
WARM_UP = "Engineers who run retrieval services send the same manuals to the model again and again."
REPLY = " Assistant: Noted. The ledger, the storm and the harbour office are in my notes; go on.\n"


class Traffic:
    """Counts every HTTP response body this process receives (all httpx clients, any route, and the
    standard library's client that reads the chunk bodies)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.responses = 0
        self.by_route: dict[str, int] = {}

    def install(self) -> None:
        import httpx

        traffic, original = self, httpx.HTTPTransport.handle_request

        class Counted(httpx.SyncByteStream):
            def __init__(self, stream, route: str):
                self.stream, self.route = stream, route

            def __iter__(self):
                for piece in self.stream:
                    traffic.bytes += len(piece)
                    traffic.by_route[self.route] = traffic.by_route.get(self.route, 0) + len(piece)
                    yield piece

            def close(self) -> None:
                self.stream.close()

        def handle_request(transport, request):
            response = original(transport, request)
            traffic.responses += 1
            path = request.url.path
            route = (
                "chunk GET"
                if request.method == "GET"
                else f"{request.method} {re.sub(r'/[0-9a-f-]{16,}', '/ID', path)}"
            )
            response.stream = Counted(response.stream, route)
            return response

        httpx.HTTPTransport.handle_request = handle_request
        self._install_http_client()

    def _install_http_client(self) -> None:
        """The chunk GETs that :class:`kvcdn_hosted.objects.ObjectReader` makes with the standard
        library's client: every response, and every body byte it reads."""
        import http.client

        traffic, response = self, http.client.HTTPResponse
        begin, readinto, read = response.begin, response.readinto, response.read

        def counted(n: int) -> None:
            traffic.bytes += n
            traffic.by_route["chunk GET"] = traffic.by_route.get("chunk GET", 0) + n

        def counted_begin(self) -> None:
            begin(self)
            traffic.responses += 1

        def counted_readinto(self, b) -> int:
            n = readinto(self, b)
            counted(n)
            return n

        def counted_read(self, amt=None) -> bytes:
            data = read(self, amt)
            if amt is None:  # read(amt) reads through readinto, counted there
                counted(len(data))
            return data

        response.begin, response.readinto, response.read = counted_begin, counted_readinto, counted_read  # type: ignore[method-assign]

    def reset(self) -> None:
        self.bytes, self.responses, self.by_route = 0, 0, {}


class CpuMeter:
    """CPU time a request costs: this process's (every thread: the forward, the connector's copies,
    fetches and checks, the tier's background work), that of ``others`` (the hosted server, the paced
    link: processes on the same cores), and the machine's busy time on all its cores (``/proc/stat``,
    whatever ran). Where the machine's busy time is near cores x wall time, CPU time is latency: on
    2 cores every millisecond of CPU a load adds shows in the first token."""

    def __init__(self) -> None:
        self.others: list[int] = []
        self._tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[float, float, float]:
        """(this process's CPU s, ``others``' CPU s, the machine's busy s), each since some origin."""
        return time.process_time(), sum(self._of(pid) for pid in self.others), self._machine()

    def threads(self) -> dict[str, float]:
        """This process's CPU s by thread, named as Python names them (a pool's threads summed under
        its prefix); threads Python did not start (torch's, vLLM's native ones) under "other"."""
        import threading

        names = {t.native_id: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
        out: dict[str, float] = {}
        for task in Path("/proc/self/task").iterdir():
            name = names.get(int(task.name), "other")
            out[name] = out.get(name, 0.0) + self._of(f"self/task/{task.name}")
        return out

    def _of(self, pid: int | str) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone: it costs nothing more
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime

    def _machine(self) -> float:
        try:
            first = Path("/proc/stat").read_text().splitlines()[0].split()
        except OSError:
            return math.nan
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
        return (user + nice + system + irq + softirq + steal) / self._tick

    @staticmethod
    def spent(before: tuple[float, float, float], after: tuple[float, float, float], wall_s: float) -> dict:
        here, others, machine = (b - a for a, b in zip(before, after))
        return {"cpu_ms": here * 1000, "others_cpu_ms": others * 1000, "cores_busy": machine / wall_s}


#: the requests' CPU meter; the hosted server's process joins ``others`` once it runs
CPU = CpuMeter()


class Lines(logging.Handler):
    """The connector's log lines (its logger sits under vLLM's)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        """The lines since the last take; (re)attaches, since each engine's start re-applies vLLM's
        logging set-up, which clears the handlers of the loggers under its own."""
        logger = logging.getLogger("vllm.kvcdn_vllm")
        if self not in logger.handlers:
            logger.addHandler(self)
        lines, self.lines = self.lines, []
        return lines


def lookup_ms(lines: list[str]) -> list[float]:
    return [float(m.group(1)) for line in lines if (m := re.search(r"store lookup ([0-9.]+) ms", line))]


def lookup_cpu_ms(lines: list[str]) -> list[float]:
    """The scheduler thread's CPU time within each lookup (the rest waited on the store)."""
    return [
        float(m.group(1)) for line in lines if (m := re.search(r"store lookup [0-9.]+ ms \(([0-9.]+) ms CPU", line))
    ]


def load_figures(params: dict) -> dict:
    """The connector's per-request figures, from the request's ``kv_transfer_params``."""
    keys = ("loaded_tokens", "chunks_memory", "chunks_disk", "chunks_remote", "bytes_fetched")
    return {key: int(params.get(f"kvcdn_{key}", 0)) for key in keys}


def kvcdn_command(given: str | None) -> list[str]:
    """How to run ``kvcdn serve``: ``--kvcdn``, else the ``kvcdn`` on PATH (the vLLM environment
    usually lacks the server's dependencies), else this Python's."""
    if given:
        return given.split()
    found = shutil.which("kvcdn")
    return [found] if found else [sys.executable, "-m", "kvcdn_core"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


PROFILES: dict[str, str] = {}


def profiled(name: str | None, call):
    """``call()``; with a name (``--profile``), under cProfile, its top functions kept in PROFILES."""
    if name is None:
        return call()
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(call)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(14)
    stats.sort_stats("cumulative").print_stats("kvcdn", 14)
    PROFILES[name] = text.getvalue()
    return result


def timed(llm, prompt: list[int], reps: int, traffic: Traffic, lines: Lines, profile: str | None = None) -> list[dict]:
    """``reps`` requests of ``prompt``, each with its TTFT, connector figures, HTTP bytes and lookups;
    the first under cProfile when ``profile`` names it."""
    out = []
    for rep in range(reps):
        traffic.reset()
        lines.take()
        before, threads = CPU.read(), CPU.threads()
        times, result = profiled(profile if rep == 0 else None, lambda: ttft(llm, prompt, 1))
        spent = CPU.spent(before, CPU.read(), times[0])
        after = CPU.threads()
        spent["cpu_by_thread_ms"] = {k: round((v - threads.get(k, 0.0)) * 1000) for k, v in after.items()}
        params = dict(result.kv_transfer_params or {})
        got = lines.take()
        out.append(
            {
                "ttft_s": times[0],
                **spent,
                "cached_tokens": result.num_cached_tokens,
                "kv_transfer_params": params,
                "http_body_bytes": traffic.bytes,
                "http_responses": traffic.responses,
                "http_by_route": dict(traffic.by_route),
                "lookup_ms": lookup_ms(got),
                "lookup_cpu_ms": lookup_cpu_ms(got),
                "load": load_figures(params),
            }
        )
    return out


def time_lookups(finder, prompt: list[int], count: int) -> dict:
    times = []
    for _ in range(count):
        began = time.perf_counter()
        match = finder.lookup(prompt)
        times.append((time.perf_counter() - began) * 1000)
    return {
        "count": count,
        "first_ms": times[0],
        "p50_ms": statistics.median(times),
        "p99_ms": percentile(times, 0.99),
        "matched_tokens": match.prefix_tokens if match else 0,
    }


def link_speed(finder, prompt: list[int], tokens: int) -> dict:
    """The chunks holding the prompt's first ``tokens`` tokens fetched through the lookup's own
    source (signed GETs from the service, or reads from the store directory) into memory already
    touched, as the tier's buffers are: once one at a time, once as many at a time as the tier
    fetches. The faster is the link's speed the goals use."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcdn_vllm import lookup
    from kvcdn_vllm.tier import FETCH_STREAMS

    match = finder.lookup(prompt)
    plan = lookup.plan(match.record, 0, tokens, match.locations)
    finder.locate(plan)
    out: dict = {"streams": FETCH_STREAMS}
    for key, streams in (("one_stream_s", 1), ("streams_s", FETCH_STREAMS)):
        buffers = [memoryview(bytearray(part.bytes)) for part in plan.parts]  # touched, as the tier's are
        began = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            moved = sum(
                len(b) for b in pool.map(lambda pb: finder.fetch(pb[0].digest, pb[1]), zip(plan.parts, buffers))
            )
        out[key] = time.perf_counter() - began
    out["bytes"], out["seconds"] = moved, min(out["one_stream_s"], out["streams_s"])
    out["mb_per_s"] = moved / out["seconds"] / 1e6
    return out


def prefix_chunk_bytes(record, tokens: int) -> int:
    """Bytes of the stored objects (chunks or pieces) that hold the record's first ``tokens`` tokens."""
    total, t0 = 0, 0
    for chunk in record.chunks:
        for part in chunk.parts:
            if t0 < tokens:
                total += part.bytes
            t0 += part.tokens
    return total


def conversation(session, turns: int, turn_tokens: int) -> list[list[int]]:
    """The prompt of each turn: every earlier turn, a user message, each turn's ids extending the last's."""
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", SAMPLE_TEXT) if s.strip()]
    enc = session.adapter.encode_continuation
    reply = enc(session.tokenizer, REPLY)
    prompts, ids, k = [], session.adapter.encode_context(session.tokenizer, "A conversation about a ledger.\n"), 0
    for turn in range(turns):
        message: list[int] = enc(session.tokenizer, f" User {turn + 1}:")
        while len(message) + len(reply) < turn_tokens:
            message += enc(session.tokenizer, " " + sentences[k % len(sentences)])
            k += 1
        ids = ids + message
        prompts.append(ids)
        ids = ids + reply
    return prompts


def serve_conversation(llm, prompts: list[list[int]], lines: Lines, profile: str | None = None) -> dict:
    """One request per turn; with ``profile``, the last turn under cProfile."""
    times, cached = [], []
    lines.take()
    for i, prompt in enumerate(prompts):
        t, result = profiled(profile if i == len(prompts) - 1 else None, lambda: ttft(llm, prompt, 1))
        times.append(t[0])
        cached.append(result.num_cached_tokens)
    later = times[1:]
    return {
        "ttft_s": times,
        "cached_tokens": cached,
        "median_later_s": statistics.median(later),
        "mean_later_s": statistics.fmean(later),
        "lookup_ms": lookup_ms(lines.take()),
    }


def save_conversation(args, model: str, turns: list[list[int]], warm: list[int], work: Path, lines: Lines) -> dict:
    """Figure 3's second half: the conversation through an engine with ``save`` on into a new local
    directory store, then what that store holds."""
    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store.chunkstore import ChunkStore

    saving = work / "saving"
    tier = {"tier_directory": str(work / "tier-saving"), "tier_memory_bytes": 1 << 30}
    llm = engine(model, kvcdn({**tier, "store": str(saving), "save": True}), prefix_caching=True, in_process=True)
    ttft(llm, warm, 1)
    served = serve_conversation(llm, turns, lines, "conversation_save_last_turn" if args.profile else None)
    lines.take()
    close(llm)
    summary = [line for line in lines.take() if "summary" in line]
    store = ChunkStore(LocalStorage(saving))
    records = [store.record(n) for n in store.names()]
    final = max(records, key=lambda r: r.token_count)
    return {
        "conversation_save": served,
        "conversation_store": {
            "final_tokens": len(turns[-1]),
            "saved_artifacts": len(records),
            "largest_saved_tokens": final.token_count,
            "final_own_bytes": final.size,  # the saved `.kv` file's bytes
            "stored_bytes": dir_bytes(saving),
            "summary": summary,
        },
    }


def build_stores(args, work: Path, real: Path, model_info: dict, server) -> dict:
    """The hosted service and the local directory, each with the synthetic artifacts and the real one."""
    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store.chunkstore import ChunkStore
    from kvcdn_hosted.storage import HostedStorage
    from tests.support.storefiles import write_kinds

    hosted = HostedStorage.from_uri("kvcdn+" + server.url)
    local = ChunkStore(LocalStorage(work / "store"))
    synthetic = work / "synthetic"
    synthetic.mkdir()

    def put(i: int) -> None:
        path = synthetic / f"s{i:05d}.kv"
        write_kinds(path, ["full_attention"] * 2, 512, seed=1_000_003 + i, model=model_info)
        hosted.upload_chunked(path, f"s{i:05d}")
        local.put(path, f"s{i:05d}")
        path.unlink()

    began = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(put, range(args.artifacts)))
    loaded_s = time.perf_counter() - began
    uploaded = hosted.upload_chunked(real, "document")
    local.put(real, "document")
    import httpx

    grant = httpx.post(f"{server.url}/api/v1/artifacts/{uploaded.artifact_id}/chunks", headers=hosted.client.headers())
    from kvcdn_core.store.record import ArtifactRecord

    record = ArtifactRecord.from_json(json.dumps(grant.json()["record"]).encode(), "document")
    hosted.close()
    return {"loaded_s": loaded_s, "hosted_record": record, "local_record": local.record("document")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=int, default=1000, help="synthetic artifacts in each store")
    parser.add_argument("--prefix", type=int, default=2048, help="tokens of the shared document")
    parser.add_argument("--reps", type=int, default=3, help="requests where a row says 'later'")
    parser.add_argument("--lookups", type=int, default=50, help="lookups timed outside the engines")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=100, help="tokens per turn (message and reply)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1))
    parser.add_argument("--kvcdn", default=None, help="command that runs kvcdn with the server (default: found)")
    parser.add_argument("--profile", action="store_true", help="cProfile the kvcdn requests and the last saved turn")
    parser.add_argument(
        "--conversation-only",
        action="store_true",
        help="only figure 3: the conversation without a connector, then with save on (no stores, no server)",
    )
    parser.add_argument(
        "--link-mb-per-s",
        type=float,
        default=None,
        help="reach the hosted store through a link paced to this many MB/s (default: loopback as it is)",
    )
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--json", default=None, help="also write the JSON results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # every engine in this process
    os.environ["KVCDN_TELEMETRY"] = "0"
    for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
        os.environ.pop(name, None)
    import torch

    torch.set_num_threads(args.threads)  # before vLLM's CPU worker stops set_num_threads
    from kvcdn_vllm import lookup

    from kvcdn_core import artifact, runtime
    from kvcdn_core.testing.smollm2 import smollm2_dir
    from tests.support import services
    from tests.support.hosted import mint_key

    traffic, lines = Traffic(), Lines()
    traffic.install()

    def prof(name: str) -> str | None:
        return name if args.profile else None

    model = str(smollm2_dir())
    work = Path(tempfile.mkdtemp(prefix="kvcdn-vllm-fleet-"))
    results: dict = {
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg(),
        "artifacts": args.artifacts,
    }
    began = time.perf_counter()
    try:
        session = runtime.load_session(model, device="cpu", dtype="float32")
        document = document_ids(session, args.prefix)
        stored_ids = document + session.adapter.encode_continuation(session.tokenizer, QUESTION_STORED)
        prompt = document + session.adapter.encode_continuation(session.tokenizer, QUESTION_ASKED)
        assert prompt[: len(document) + 1] != stored_ids[: len(document) + 1]
        warm = session.adapter.encode_context(session.tokenizer, WARM_UP)
        turns = conversation(session, args.turns, args.turn_tokens)
        if args.conversation_only:
            del session
            llm = engine(model, None, prefix_caching=True, in_process=True)
            ttft(llm, warm, 1)
            results["conversation_no_connector"] = serve_conversation(
                llm, turns, lines, prof("conversation_no_connector_last_turn")
            )
            close(llm)
            results.update(save_conversation(args, model, turns, warm, work, lines))
            results["load_average_end"] = os.getloadavg()
            results["profiles"] = PROFILES
            results["wall_s"] = time.perf_counter() - began
            report_conversation(results, args)
            return 0
        real = work / "document.kv"
        runtime.save_cache(session, runtime.prefill(session, stored_ids, progress=False)[0], stored_ids, "", real)
        del session
        model_info = artifact.read_manifest(real)["model"]
        results["prompt_tokens"] = len(prompt)
        results["shared_prefix_tokens"] = len(document)

        quota = {"KVCDN_QUOTA_ARTIFACTS": str(args.artifacts + 10)}  # the default is 1,000 per tenant
        link_port = services.free_port() if args.link_mb_per_s else None
        public = ["--public-url", f"http://127.0.0.1:{link_port}"] if link_port else []
        with (
            services.kvcdn_server(work / "home", public, env=quota, kvcdn=kvcdn_command(args.kvcdn)) as server,
            paced(server.url, link_port, args.link_mb_per_s) as hosted_url,
        ):
            os.environ["KVCDN_API_KEY"] = mint_key(server.url, server.admin_secret(), "fleet")
            CPU.others.append(server.process.pid)
            stores = build_stores(args, work, real, model_info, server)
            results["stores_loaded_s"] = stores["loaded_s"]
            results["link_mb_per_s"] = args.link_mb_per_s
            hosted_uri = "kvcdn+" + hosted_url

            def tiered(tier: str, **more) -> dict:
                return kvcdn({"tier_directory": str(work / tier), "tier_memory_bytes": 1 << 30, **more})

            # 1. vLLM alone, prefix cache on: cold, the hit, the conversation without a connector
            llm = engine(model, None, prefix_caching=True, in_process=True)
            ttft(llm, warm, 1)
            cold = timed(llm, prompt, 1, traffic, lines)[0]
            apc = timed(llm, prompt, args.reps, traffic, lines, prof("apc_hit"))
            results["conversation_no_connector"] = serve_conversation(
                llm, turns, lines, prof("conversation_no_connector_last_turn")
            )
            close(llm)
            results["cold"] = cold
            results["apc_hit"] = apc

            # 2. kvcdn on the hosted service, empty tier: from the store, then from memory
            llm = engine(model, tiered("tier-hosted", store=hosted_uri), in_process=True)
            ttft(llm, warm, 1)
            results["hosted_remote"] = timed(llm, prompt, 1, traffic, lines, prof("hosted_remote"))[0]
            results["hosted_memory"] = timed(llm, prompt, args.reps, traffic, lines, prof("hosted_memory"))
            close(llm)

            # 3. the same tier directory, a new engine: the disk tier, then memory
            llm = engine(model, tiered("tier-hosted", store=hosted_uri), in_process=True)
            ttft(llm, warm, 1)
            results["hosted_disk_first"] = timed(llm, prompt, 1, traffic, lines, prof("hosted_disk_first"))[0]
            results["hosted_disk_later"] = timed(llm, prompt, args.reps, traffic, lines)
            close(llm)

            # the lookup alone, as the scheduler makes it
            root = lookup.engine_root(model_info, "float32")
            finder = lookup.open_lookup(hosted_uri, root, print)
            results["lookup_hosted"] = time_lookups(finder, prompt, args.lookups)
            results["link_hosted"] = link_speed(finder, prompt, len(document))
            finder.backend.close()
            finder = lookup.open_lookup(str(work / "store"), root, print)
            results["lookup_local"] = time_lookups(finder, prompt, args.lookups)
            results["link_local"] = link_speed(finder, prompt, len(document))
            hosted_record = stores["hosted_record"]
            CPU.others.clear()  # the server stops here

        # 4. kvcdn on the local directory store, empty tier
        llm = engine(model, tiered("tier-local", store=str(work / "store")), in_process=True)
        ttft(llm, warm, 1)
        results["local_remote"] = timed(llm, prompt, 1, traffic, lines, prof("local_remote"))[0]
        close(llm)

        # 5. vLLM's example disk connector
        example = work / "example"
        example.mkdir()
        llm = engine(
            model,
            {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(example)}},
            in_process=True,
        )
        ttft(llm, warm, 1)
        store_times, _ = ttft(llm, prompt, 1)
        written = dir_bytes(example)
        loads = timed(llm, prompt, args.reps, traffic, lines)
        close(llm)
        results["example_connector"] = {"storing_request_s": store_times[0], "bytes_written": written, "loads": loads}

        # 6. the conversation with save on (prefix cache on, as a serving engine runs)
        results.update(save_conversation(args, model, turns, warm, work, lines))
        results["hosted_prefix_chunk_bytes"] = prefix_chunk_bytes(hosted_record, len(document))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_average_end"] = os.getloadavg()
    results["profiles"] = PROFILES
    results["wall_s"] = time.perf_counter() - began
    report(results, args)
    return 0


@contextlib.contextmanager
def paced(server_url: str, port: int | None, mb_per_s: float | None):
    """The URL the engines reach the hosted store at: the server's own, or with ``port`` a
    ``paced_link.py`` proxy on it, forwarding to the server through a link of ``mb_per_s``."""
    if port is None:
        yield server_url
        return
    script = Path(__file__).resolve().parent / "paced_link.py"
    target = server_url.rsplit(":", 1)[1]
    proxy = subprocess.Popen(
        [sys.executable, str(script), str(port), target, str(mb_per_s)], stdout=subprocess.PIPE, text=True
    )
    try:
        if proxy.stdout is None or proxy.stdout.readline().strip() != "ready":
            raise RuntimeError("the paced link did not start")
        CPU.others.append(proxy.pid)
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.terminate()
        proxy.wait(30)


def cpu_spent(runs: list[dict]) -> str:
    """The runs' median CPU (this process, plus the server's where it ran) and busy cores."""
    if not runs or "cpu_ms" not in runs[0]:
        return ""
    here = statistics.median(x["cpu_ms"] for x in runs)
    others = statistics.median(x["others_cpu_ms"] for x in runs)
    busy = statistics.median(x["cores_busy"] for x in runs)
    return f"{here:.0f}" + (f" + {others:.0f}" if others else "") + f"; {busy:.2f}"


def median_ttft(runs: list[dict]) -> float:
    return statistics.median(x["ttft_s"] for x in runs)


def goals(r: dict) -> dict:
    """The issue's ratios from this run's figures, each with its goal."""
    apc = median_ttft(r["apc_hit"])
    prefix = r["hosted_prefix_chunk_bytes"]
    remote = r["hosted_remote"]
    out = {
        # nothing loaded is no fetch at all, not a ratio met
        "fetch_ratio": remote["load"]["bytes_fetched"] / prefix if remote["load"]["loaded_tokens"] else math.inf,
        "http_ratio": remote["http_body_bytes"] / prefix,
        "lookup_hosted_p50_ms": r["lookup_hosted"]["p50_ms"],
        "tier_first_x_apc": r["hosted_disk_first"]["ttft_s"] / apc,
        "tier_later_x_apc": median_ttft(r["hosted_disk_later"]) / apc,
        "memory_later_x_apc": median_ttft(r["hosted_memory"]) / apc,
    }
    for name, run in (("hosted", remote), ("local", r["local_remote"])):
        transfer = run["load"]["bytes_fetched"] / (r[f"link_{name}"]["mb_per_s"] * 1e6)
        out[f"{name}_remote_goal_s"] = 1.1 * apc + transfer
        out[f"{name}_remote_s"] = run["ttft_s"]
    st, on, off = r["conversation_store"], r["conversation_save"], r["conversation_no_connector"]
    out["stored_ratio"] = st["stored_bytes"] / st["final_own_bytes"]
    out["save_ttft_change"] = on["median_later_s"] / off["median_later_s"] - 1
    out["met"] = {
        "fetch <= 1.1x prefix chunk bytes": out["fetch_ratio"] <= 1.1,
        "all HTTP bodies <= 1.1x prefix chunk bytes": out["http_ratio"] <= 1.1,
        "hosted lookup p50 <= 5 ms": out["lookup_hosted_p50_ms"] <= 5,
        "tier first request <= 1.1x APC": out["tier_first_x_apc"] <= 1.1,
        "tier later requests <= 1.0x APC": out["tier_later_x_apc"] <= 1.0,
        "hosted remote <= 1.1x APC + transfer": out["hosted_remote_s"] <= out["hosted_remote_goal_s"],
        "local remote <= 1.1x APC + transfer": out["local_remote_s"] <= out["local_remote_goal_s"],
        "stored <= 1.3x final conversation": out["stored_ratio"] <= 1.3,
        "save on TTFT within 10% of off": abs(out["save_ttft_change"]) <= 0.10,
    }
    return out


def dumped(r: dict, args) -> bool:
    """Write the figures to ``--json`` if asked; True when ``--format json`` printed them instead of a report."""
    text = json.dumps(r, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    if args.format == "json":
        print(text)
    return args.format == "json"


def report_conversation(r: dict, args) -> None:
    """``--conversation-only``: figure 3's figures (stored bytes and the TTFT with save on against off)."""
    st, on, off = r["conversation_store"], r["conversation_save"], r["conversation_no_connector"]
    r["goals"] = {
        "stored_ratio": st["stored_bytes"] / st["final_own_bytes"],
        "save_ttft_change": on["median_later_s"] / off["median_later_s"] - 1,
    }
    if dumped(r, args):
        return
    g = r["goals"]
    print(
        f"conversation, {len(on['ttft_s'])} turns, final {st['final_tokens']} tokens, prefix cache on; "
        f"{r['threads']} thread(s), load {r['load_average_start'][0]:.1f} -> {r['load_average_end'][0]:.1f}"
    )
    print(
        f"TTFT of turns 2-{len(on['ttft_s'])}, median: no connector {off['median_later_s']:.3f} s, "
        f"save on {on['median_later_s']:.3f} s ({g['save_ttft_change']:+.1%}); "
        f"mean {off['mean_later_s']:.3f} / {on['mean_later_s']:.3f} s"
    )
    print(
        f"stored {st['stored_bytes']:,} bytes / the final conversation's own {st['final_own_bytes']:,} = "
        f"{g['stored_ratio']:.3f} ({st['saved_artifacts']} artifacts saved)"
    )
    for line in st["summary"]:
        print(line)
    for name, text in r["profiles"].items():
        print(f"--- profile: {name}\n{text}")


def report(r: dict, args) -> None:
    r["goals"] = goals(r)
    if dumped(r, args):
        return
    apc, g = median_ttft(r["apc_hit"]), r["goals"]

    def row(name: str, runs: list[dict], note: str = "") -> str:
        t, last = median_ttft(runs), runs[-1]
        load = last["load"]
        chunks = (
            f"{load['chunks_memory']}/{load['chunks_disk']}/{load['chunks_remote']}" if load["loaded_tokens"] else ""
        )
        looked = [ms for x in runs for ms in x["lookup_ms"]]
        cpu = [ms for x in runs for ms in x.get("lookup_cpu_ms", [])]
        looked = f"{statistics.median(looked):.1f}" if looked else ""
        looked += f" ({statistics.median(cpu):.1f} CPU)" if cpu else ""
        return (
            f"| {name} | {t:.3f} s | {t / apc:.2f}x | {last['cached_tokens']} | {chunks} | "
            f"{load['bytes_fetched']:,} | {last['http_body_bytes']:,} | {looked} | {cpu_spent(runs)} | {note} |"
        )

    print(
        f"threads {r['threads']} (of {r['cpu_count']} CPUs), load {r['load_average_start'][0]:.1f} at start, "
        f"{r['load_average_end'][0]:.1f} at end; prompt {r['prompt_tokens']} tokens sharing "
        f"{r['shared_prefix_tokens']} with one of {r['artifacts']} + 1 artifacts (stores filled in "
        f"{r['stores_loaded_s']:.0f} s); run {r['wall_s']:.0f} s"
    )
    paced_at = r.get("link_mb_per_s")
    print(f"the hosted store behind a link paced to {paced_at:g} MB/s\n" if paced_at else "")
    print(
        f"| first token (median of {len(r['apc_hit'])} where 'later') | TTFT | x APC hit | cached tokens "
        "| chunks memory/disk/remote | bytes fetched | HTTP body bytes | lookup ms (median; CPU here) "
        "| CPU ms here + server; cores busy | |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(row("cold (vLLM alone)", [r["cold"]]))
    print(row("vLLM prefix-cache hit, later (the floor)", r["apc_hit"]))
    print(row("kvcdn, hosted store, empty tier", [r["hosted_remote"]], f"goal <= {g['hosted_remote_goal_s']:.3f} s"))
    print(row("kvcdn, memory tier, later", r["hosted_memory"]))
    print(row("kvcdn, disk tier, new engine, first", [r["hosted_disk_first"]]))
    print(row("kvcdn, memory tier, that engine, later", r["hosted_disk_later"]))
    print(
        row(
            "kvcdn, local store directory, empty tier", [r["local_remote"]], f"goal <= {g['local_remote_goal_s']:.3f} s"
        )
    )
    ex = r["example_connector"]
    print(row("vLLM ExampleConnector, later", ex["loads"], f"storing request {ex['storing_request_s']:.3f} s"))
    print()
    for key in ("link_hosted", "link_local"):
        lk = r[key]
        print(
            f"{key}: {lk['bytes']:,} bytes in {lk['one_stream_s']:.3f} s one at a time, {lk['streams_s']:.3f} s "
            f"{lk['streams']} at a time: {lk['mb_per_s']:.0f} MB/s"
        )
    remote = r["hosted_remote"]
    print(
        f"fetch, hosted: {remote['load']['bytes_fetched']:,} chunk bytes / the prefix's {r['hosted_prefix_chunk_bytes']:,}"
        f" = {g['fetch_ratio']:.3f}; every HTTP body {remote['http_body_bytes']:,} = {g['http_ratio']:.3f} "
        f"({remote['http_by_route']})"
    )
    for name in ("lookup_hosted", "lookup_local"):
        lk = r[name]
        print(
            f"{name}: {lk['count']} lookups, first {lk['first_ms']:.1f} ms, p50 {lk['p50_ms']:.1f} ms, "
            f"p99 {lk['p99_ms']:.1f} ms, {lk['matched_tokens']} tokens matched"
        )
    off, on, st = r["conversation_no_connector"], r["conversation_save"], r["conversation_store"]
    print(
        f"conversation, {len(on['ttft_s'])} turns, final {st['final_tokens']} tokens, prefix cache on: TTFT of turns "
        f"2-{len(on['ttft_s'])}, median {off['median_later_s']:.3f} s without connector, {on['median_later_s']:.3f} s "
        f"with save ({g['save_ttft_change']:+.1%}); mean {off['mean_later_s']:.3f} / {on['mean_later_s']:.3f} s"
    )
    print(
        f"stored {st['stored_bytes']:,} bytes / the final conversation's own {st['final_own_bytes']:,} = "
        f"{g['stored_ratio']:.3f} ({st['saved_artifacts']} artifacts saved, the largest {st['largest_saved_tokens']} "
        f"tokens); {' '.join(st['summary'])}"
    )
    print()
    for goal, met in g["met"].items():
        print(f"{'met   ' if met else 'MISSED'} {goal}")
    for name, text in r["profiles"].items():
        print(f"\n== profile: {name} ==\n{text}")


if __name__ == "__main__":  # vLLM may spawn processes that re-import this file
    raise SystemExit(main())
