"""The timed runs of `kvcdn benchmark`: prefill, the resident cache, and cold loads per scheme.

Every number is measured on the real code path: the same prefill, artifact writer, loader and
quantizers the other commands use. Each measurement gets one warm-up run, then ``reps`` timed runs,
and the median is reported. Loads are timed from a cold file (the page cache dropped before each
run and the drop checked, :class:`kvcdn_core.artifact.pagecache.PageCache`) so that ``load_s`` is what a
fresh process pays. Torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path
from typing import Any

from kvcdn_core.artifact.pagecache import PageCache
from kvcdn_core.benchmark.inputs import check_lengths, set_threads
from kvcdn_core.benchmark.result import BenchResult, BenchRow
from kvcdn_core.benchmark.timing import (
    attention_flops,
    count_matmul_flops,
    load_average,
    plain_read,
    stat,
    sync,
    timed_runs,
)
from kvcdn_core.errors import KvcdnError


def run_benchmark(
    session,
    ids: list[int],
    lengths: list[int],
    reps: int,
    schemes: list[str],
    workdir: Path,
    question: str,
    page_cache: PageCache,
    context_source: str,
    progress: bool = True,
    threads: int | None = None,
) -> BenchResult:
    """Measure every length and scheme; artifacts are written under ``workdir`` and removed.

    ``threads``: torch intra-op threads (default: the physical cores), set before anything is timed.
    """
    import torch

    from kvcdn_core import artifact, runtime
    from kvcdn_core.progress import Progress

    if reps < 1:
        raise KvcdnError("--reps must be at least 1")
    check_lengths(session, lengths)
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    if not question_ids:
        raise KvcdnError("the question has no tokens")
    threads = set_threads(threads)
    load_start = load_average()
    device = session.device
    per_length = (3 + len(schemes)) * (reps + 1)  # prefill, one step, the question, a load per scheme
    rows: list[BenchRow] = []
    workdir.mkdir(parents=True, exist_ok=True)

    def forward(cache, piece):
        logits, cache = session.adapter.last_logits(session.model, runtime._ids_tensor(session, piece), cache)
        return int(torch.argmax(logits)), cache

    with torch.inference_mode(), Progress(per_length * len(lengths), "benchmark", unit="runs", enabled=progress) as bar:
        tick = lambda: bar.update(1)  # noqa: E731
        for length in lengths:
            ctx = ids[:length]

            def full_prefill():
                cache, logits = runtime.prefill(session, ctx, progress=False)
                token = int(torch.argmax(logits))
                sync(device)
                return cache, token

            flops = {}

            def counted_prefill():
                flops["matmul"], _ = count_matmul_flops(full_prefill)

            prefill, (cache, first) = timed_runs(full_prefill, reps, tick, warmup=counted_prefill)
            total_flops = flops["matmul"] + attention_flops(session.model.config, length)

            def on_resident(piece):
                """Time ``piece`` fed on a copy of the resident cache (the copy is not timed)."""

                def run():
                    resident = copy.deepcopy(cache)  # noqa: F821 - the loop's cache, called within the iteration
                    sync(device)
                    start = time.perf_counter()
                    forward(resident, piece)
                    sync(device)
                    return time.perf_counter() - start

                samples = [run() for _ in range(reps + 1)]  # the first is the warm-up
                for _ in samples:
                    tick()
                return stat(samples[1:])

            step = on_resident([first])
            question_time = on_resident(question_ids)
            # The reference for the loaded caches: the question continued on the resident cache
            # the artifact is saved from; a loaded unquantized artifact must give the same token.
            expected, _ = forward(copy.deepcopy(cache), question_ids)

            base = runtime.save_cache(
                session, cache, ctx, runtime.decode(session, ctx), workdir / f"bench-{length}-none.kv"
            )
            del cache
            header = artifact.read_header(base)
            kv_bytes = sum(
                e["data_offsets"][1] - e["data_offsets"][0]
                for name, e in header.entries.items()
                if name != artifact.TOKEN_IDS
            )
            compute = dict(
                tokens=length,
                prefill_s=prefill[1],
                kv_attn_s=step[1],
                kv_mb=kv_bytes / 1e6,
                prefill_gflops=total_flops / 1e9 / prefill[1],
                speedup_compute=prefill[1] / step[1],
                question_s=question_time[1],
                threads=threads,
            )
            spread = {"prefill_s": prefill, "kv_attn_s": step, "question_s": question_time}
            for scheme in schemes:
                path = base if scheme == "none" else quantize(base, scheme, workdir / f"bench-{length}-{scheme}.kv")
                rows.append(
                    _measure_load(
                        session, path, scheme, question_ids, expected, reps, page_cache, tick, forward, compute, spread
                    )
                )
                if path != base:
                    path.unlink(missing_ok=True)
            base.unlink(missing_ok=True)
    return BenchResult(
        rows,
        page_cache.describe(),
        page_cache.method or "none",
        page_cache.max_resident,
        context_source,
        threads,
        (load_start, load_average()),
    )


def _measure_load(
    session,
    path: Path,
    scheme: str,
    question_ids,
    expected: int,
    reps: int,
    page_cache: PageCache,
    tick,
    forward,
    compute: dict,
    spread: dict,
) -> BenchRow:
    """Per rep, each from a cold file: a plain read, the load + question (sequential and
    pipelined) and the load without hashes. Rep 0 is the warm-up."""
    from kvcdn_core import artifact, runtime

    size = path.stat().st_size
    samples: dict[str, list[float]] = {
        name: [] for name in ("plain_read_s", "load_s", "ttft_cached_s", "ttft_pipelined_s", "load_unverified_s")
    }
    tokens = []

    def cold(fn) -> tuple[float, float, Any]:
        """``fn`` on a cold file: (start, end, result)."""
        page_cache.drop(path)
        start = time.perf_counter()
        result = fn()
        sync(session.device)
        return start, time.perf_counter(), result

    def cached_ttft(stream: bool) -> float:
        cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=stream)
        sync(session.device)
        loaded = time.perf_counter()
        token, _ = forward(cache, question_ids)
        tokens.append(token)
        return loaded

    for rep in range(reps + 1):
        start, end, _ = cold(lambda: plain_read(path))
        runs = {"plain_read_s": end - start}
        start, end, loaded = cold(lambda: cached_ttft(stream=False))
        runs.update(load_s=loaded - start, ttft_cached_s=end - start)
        start, end, _ = cold(lambda: cached_ttft(stream=True))
        runs["ttft_pipelined_s"] = end - start
        start, end, _ = cold(lambda: runtime.load_cache(session, artifact.read_header(path), verify_hashes=False))
        runs["load_unverified_s"] = end - start
        if rep:  # rep 0 is the warm-up
            for name, value in runs.items():
                samples[name].append(value)
        tick()
    stats = {name: stat(values) for name, values in samples.items() if values}
    med = {name: values[1] for name, values in stats.items()}
    return BenchRow(
        **compute,
        scheme=scheme,
        load_s=med["load_s"],
        load_gbps=size / med["load_s"] / 1e9,
        ttft_cached_s=med["ttft_cached_s"],
        speedup_ttft=compute["prefill_s"] / med["ttft_cached_s"],
        artifact_bytes=size,
        plain_read_s=med["plain_read_s"],
        ttft_pipelined_s=med["ttft_pipelined_s"],
        load_unverified_s=med["load_unverified_s"],
        first_token_match=all(t == expected for t in tokens),
        spread={**spread, **stats},
        model=session.model_ref,
    )


def quantize(source: Path, scheme: str, target: Path) -> Path:
    """Quantize an artifact with an installed quantizer (the same code path as ``kvcdn quant``)."""
    from kvcdn_core import artifact
    from kvcdn_core.plugin_host.registry import quantizer_for
    from kvcdn_core.quant import codec

    header = artifact.read_header(source)
    quantizer = quantizer_for(scheme)()
    result = codec.quantize_cache(header.manifest, artifact.load_tensors(header), quantizer)
    return artifact.write_artifact(target, result.manifest, result.tensors)


@contextlib.contextmanager
def scratch_dir(near: Path):
    """A private scratch directory next to the output (same file system, so not a tmpfs /tmp)."""
    import shutil
    import tempfile

    near.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".bench-", dir=near))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
