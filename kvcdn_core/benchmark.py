"""Prefill against cached continuation, measured end to end, per context length and scheme.

Users adopt caching when they can see where it pays off for their model and context length, so
every number here is measured on the real code path: the same prefill, artifact writer, loader
and quantizers the other commands use. Each measurement gets one warm-up run, then ``reps`` timed
runs, and the median is reported. Loads are timed from a cold file (the page cache dropped before
each run, and the drop checked with ``mincore``) so that ``load_s`` is what a fresh process pays.

Torch is imported lazily: the command module imports this file at call time only.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import io
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcdn_core.errors import KvcdnError
from kvcdn_core.pagecache import evict, resident_fraction
from kvcdn_core.paths import command_dir, model_slug

#: CSV columns, in the documented order: the compute group, then the per-scheme group.
CSV_COLUMNS = (
    "tokens",
    "prefill_s",
    "kv_attn_s",
    "kv_mb",
    "prefill_gflops",
    "speedup_compute",
    "scheme",
    "load_s",
    "load_gbps",
    "ttft_cached_s",
    "speedup_ttft",
    "artifact_bytes",
    # added later, so after the first ones: the physical limits the cached path is held to
    "plain_read_s",
    "load_read_ratio",
    "question_s",
    "ttft_pipelined_s",
    "ttft_limit_s",
    "speedup_pipelined",
    "threads",
)
#: Timed columns whose min and max are reported next to the median (``--format json``: ``spread``).
TIMED = (
    "prefill_s",
    "kv_attn_s",
    "question_s",
    "plain_read_s",
    "load_s",
    "load_unverified_s",
    "ttft_cached_s",
    "ttft_pipelined_s",
)
DEFAULT_LENGTHS = (255, 485, 945, 1888, 3774)
DEFAULT_REPS = 5
#: A file counts as cold when at most this fraction of its pages is resident after a drop.
COLD_RESIDENCY = 0.05


@dataclasses.dataclass
class BenchRow:
    """One CSV row (a length and a scheme) plus what the CSV leaves out (plain read, checks)."""

    tokens: int
    prefill_s: float
    kv_attn_s: float
    kv_mb: float
    prefill_gflops: float
    speedup_compute: float
    scheme: str
    load_s: float
    load_gbps: float
    ttft_cached_s: float
    speedup_ttft: float
    artifact_bytes: int
    plain_read_s: float
    question_s: float
    ttft_pipelined_s: float
    threads: int
    load_unverified_s: float = 0.0  # the same load without the sha256 check: what hashing costs
    first_token_match: bool | None = None
    spread: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)

    @property
    def plain_read_gbps(self) -> float:
        return self.artifact_bytes / self.plain_read_s / 1e9 if self.plain_read_s > 0 else 0.0

    @property
    def load_read_ratio(self) -> float:
        """How far the load is from reading its bytes (1.0: at the limit)."""
        return self.load_s / self.plain_read_s

    @property
    def ttft_limit_s(self) -> float:
        """What a cached first token cannot beat: the slower of reading the file and the question's
        forward on a resident cache (a pipelined load overlaps the two)."""
        return max(self.plain_read_s, self.question_s)

    @property
    def speedup_pipelined(self) -> float:
        return self.prefill_s / self.ttft_pipelined_s

    def csv_values(self) -> list[str]:
        return [_fmt(getattr(self, name)) for name in CSV_COLUMNS]

    def as_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in CSV_COLUMNS}
        data.update(
            plain_read_gbps=round(self.plain_read_gbps, 4),
            load_unverified_s=self.load_unverified_s,
            first_token_match=self.first_token_match,
            spread={name: list(values) for name, values in self.spread.items()},
        )
        return data


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


@dataclasses.dataclass
class BenchResult:
    rows: list[BenchRow]
    page_cache: str  # how loads were made cold, in words
    page_cache_method: str  # drop_caches | fadvise | none
    max_resident_after_drop: float | None  # worst fraction of a file still cached after a drop
    context_source: str
    threads: int = 0  # torch intra-op threads the run used
    load_average: tuple[float | None, float | None] | None = None  # 1-minute load average at the start and the end


# -- the page cache -------------------------------------------------------------------------------


class PageCache:
    """Makes a file cold before a timed read: ``/proc/sys/vm/drop_caches`` where the process may
    write it, else ``posix_fadvise(DONTNEED)`` on the file; ``mode='keep'`` leaves it warm.

    Every drop is checked with ``mincore``, so the output can say how cold the reads really were.
    """

    def __init__(self, mode: str = "file"):
        if mode not in ("auto", "system", "file", "keep"):
            raise KvcdnError(f"unknown page-cache mode '{mode}' (auto, system, file, keep)")
        self.mode = mode
        self.method: str | None = None
        self.max_resident: float | None = None

    def drop(self, path: Path) -> None:
        if self.mode == "keep":
            self.method = "none"
            return
        if self.mode in ("auto", "system") and self.method in (None, "drop_caches"):
            if _drop_system_caches():
                self.method = "drop_caches"
            elif self.mode == "system":
                raise KvcdnError("cannot write /proc/sys/vm/drop_caches (needs root on Linux); use --page-cache file")
        if self.method != "drop_caches":
            self.method = "fadvise" if evict(path) else "none"
        resident = resident_fraction(path)
        if resident is not None:
            self.max_resident = max(self.max_resident or 0.0, resident)

    def describe(self) -> str:
        if self.method in (None, "none"):
            return "warm: the page cache was not dropped, loads may read from memory"
        how = (
            "/proc/sys/vm/drop_caches (sync, then 1)"
            if self.method == "drop_caches"
            else "posix_fadvise(DONTNEED) on the artifact"
        )
        if self.max_resident is None:
            return f"dropped before each load with {how} (residency not checkable here)"
        if self.max_resident > COLD_RESIDENCY:
            return (
                f"NOT cold: after {how} up to {self.max_resident:.0%} of the file stayed "
                "in the page cache (a tmpfs or a file system that ignores the drop)"
            )
        return f"dropped before each load with {how}; at most {self.max_resident:.0%} of the file stayed resident"


def _drop_system_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def plain_read(path: Path) -> int:
    """Read a whole file into memory the simplest fast way: the physical limit a load is held to.

    Same buffer as :func:`kvcdn_core.artifact.load_tensors` (uninitialised numpy, huge pages where
    offered), so the two differ only by what loading adds: hashing, tensor views, the cache.
    """
    import numpy as np

    size = os.path.getsize(path)
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer.data)
    done = 0
    with open(path, "rb", buffering=0) as fh:
        while done < size:
            n = fh.readinto(view[done:])
            if not n:
                break
            done += n
    return done


# -- the context ----------------------------------------------------------------------------------


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise KvcdnError(f"--lengths must be comma-separated token counts, got '{text}'") from None
    if not lengths or lengths[0] < 1:
        raise KvcdnError(f"--lengths must be positive token counts, got '{text}'")
    return lengths


def parse_schemes(text: str, installed: list[str]) -> list[str]:
    """``none`` plus installed quantizer schemes; anything else is refused, naming what exists."""
    schemes = []
    for part in text.split(","):
        name = part.strip()
        if name and name not in schemes:
            schemes.append(name)
    if not schemes:
        raise KvcdnError("--scheme needs at least one scheme, e.g. none")
    unknown = [s for s in schemes if s != "none" and s not in installed]
    if unknown:
        have = ", ".join(["none", *sorted(installed)])
        raise KvcdnError(f"unknown quantization scheme(s) {', '.join(unknown)}; installed: {have}")
    return schemes


def installed_schemes() -> list[str]:
    from kvcdn_core.registry import quantizer_classes

    return sorted(quantizer_classes())


def check_lengths(session, lengths: list[int]) -> None:
    """Refuse lengths beyond the model's context window before anything is built."""
    longest = max(lengths)
    limit = getattr(session.model.config, "max_position_embeddings", None)
    if limit and longest > limit:
        raise KvcdnError(f"--lengths goes to {longest} tokens, the model's context is {limit}")


def context_ids(session, text: str | None, longest: int) -> tuple[list[int], str]:
    """Token ids covering ``longest`` tokens and a description of where they came from.

    Without a context file the sample text of the tiny models is repeated until it is long enough:
    prefill cost depends on the length, not the words, but say so in the output.
    """
    adapter, tok = session.adapter, session.tokenizer
    if text is not None:
        ids = adapter.encode_context(tok, text)
        if len(ids) < longest:
            raise KvcdnError(
                f"the context file has {len(ids)} tokens, --lengths needs {longest}; "
                "pass a longer file or smaller lengths"
            )
        return ids, f"context file ({len(ids)} tokens)"
    from kvcdn_core.tiny import SAMPLE_TEXT

    once = max(len(adapter.encode_continuation(tok, SAMPLE_TEXT)), 1)
    text = SAMPLE_TEXT * (longest // once + 2)
    ids = adapter.encode_context(tok, text)
    return ids, f"synthetic: the built-in sample text repeated to {len(ids)} tokens (no --context-file)"


# -- timing ---------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _stat(times: list[float]) -> tuple[float, float, float]:
    return min(times), statistics.median(times), max(times)


def _timed_runs(fn: Callable[[], Any], reps: int, tick: Callable[[], None], warmup=None) -> tuple[tuple, Any]:
    """One warm-up (``warmup`` or ``fn``, discarded), then ``reps`` timed calls of ``fn``;
    ``((min, median, max) s, last result)``."""
    (warmup or fn)()
    tick()
    times, last = [], None
    for _ in range(reps):
        start = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - start)
        tick()
    return _stat(times), last


def physical_cores() -> int:
    """Cores this process may run on, counting SMT siblings once: the default ``--threads``.

    More torch threads than physical cores make CPU timings swing (siblings and other processes
    preempt a thread the others wait for)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        cores.add(siblings)
    return max(1, len(cores))


def set_threads(threads: int | None) -> int:
    """Pin torch's intra-op threads (default: the physical cores); return the number used."""
    import torch

    threads = threads or physical_cores()
    if threads < 1:
        raise KvcdnError("--threads must be at least 1")
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def attention_flops(config, tokens: int) -> float:
    """Causal attention score and weighted-sum FLOPs of one prefill (SDPA is not op-counted on CPU)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    layers = getattr(text, "num_hidden_layers", 0) or 0
    pairs = tokens * (tokens + 1) / 2
    return 2 * 2 * layers * heads * head_dim * pairs


def count_matmul_flops(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` under torch's FLOP counter; ``(matmul FLOPs, result)``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = fn()
    return float(counter.get_total_flops()), result


# -- the benchmark --------------------------------------------------------------------------------


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

    from kvcdn_core import artifact as fmt
    from kvcdn_core import runtime
    from kvcdn_core.progress import Progress

    if reps < 1:
        raise KvcdnError("--reps must be at least 1")
    check_lengths(session, lengths)
    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    if not question_ids:
        raise KvcdnError("the question has no tokens")
    threads = set_threads(threads)
    load_start = _load_average()
    device = session.device
    per_length = (3 + len(schemes)) * (reps + 1)  # prefill, one step, the question, a load per scheme
    rows: list[BenchRow] = []
    workdir.mkdir(parents=True, exist_ok=True)

    def forward(cache, piece):
        out, cache = session.adapter.forward(session.model, runtime._ids_tensor(session, piece), cache)
        return int(torch.argmax(out[0, -1])), cache

    with torch.inference_mode(), Progress(per_length * len(lengths), "benchmark", unit="runs", enabled=progress) as bar:
        tick = lambda: bar.update(1)  # noqa: E731
        for length in lengths:
            ctx = ids[:length]

            def full_prefill():
                cache, logits = runtime.prefill(session, ctx, progress=False)
                token = int(torch.argmax(logits))
                _sync(device)
                return cache, token

            flops = {}

            def counted_prefill():
                flops["matmul"], _ = count_matmul_flops(full_prefill)

            prefill, (cache, first) = _timed_runs(full_prefill, reps, tick, warmup=counted_prefill)
            total_flops = flops["matmul"] + attention_flops(session.model.config, length)

            def on_resident(piece):
                """Time ``piece`` fed on a copy of the resident cache (the copy is not timed)."""

                def run():
                    resident = copy.deepcopy(cache)  # noqa: F821 - the loop's cache, called within the iteration
                    _sync(device)
                    start = time.perf_counter()
                    forward(resident, piece)
                    _sync(device)
                    return time.perf_counter() - start

                samples = [run() for _ in range(reps + 1)]  # the first is the warm-up
                for _ in samples:
                    tick()
                return _stat(samples[1:])

            step = on_resident([first])
            question_time = on_resident(question_ids)
            # The reference for the loaded caches: the question continued on the resident cache
            # the artifact is saved from; a loaded unquantized artifact must give the same token.
            expected, _ = forward(copy.deepcopy(cache), question_ids)

            base = runtime.save_cache(
                session, cache, ctx, runtime.decode(session, ctx), workdir / f"bench-{length}-none.kv"
            )
            del cache
            header = fmt.read_header(base)
            kv_bytes = sum(
                e["data_offsets"][1] - e["data_offsets"][0]
                for name, e in header.entries.items()
                if name != fmt.TOKEN_IDS
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
        (load_start, _load_average()),
    )


def _load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


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
    from kvcdn_core import artifact as fmt
    from kvcdn_core import runtime

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
        _sync(session.device)
        return start, time.perf_counter(), result

    def cached_ttft(stream: bool) -> float:
        cache, _ = runtime.load_cache(session, fmt.read_header(path), stream=stream)
        _sync(session.device)
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
        start, end, _ = cold(lambda: runtime.load_cache(session, fmt.read_header(path), verify_hashes=False))
        runs["load_unverified_s"] = end - start
        if rep:  # rep 0 is the warm-up
            for name, value in runs.items():
                samples[name].append(value)
        tick()
    stats = {name: _stat(values) for name, values in samples.items() if values}
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
    )


def quantize(source: Path, scheme: str, target: Path) -> Path:
    """Quantize an artifact with an installed quantizer (the same code path as ``kvcdn quant``)."""
    from kvcdn_core import artifact as fmt
    from kvcdn_core import quant
    from kvcdn_core.registry import quantizer_for

    header = fmt.read_header(source)
    quantizer = quantizer_for(scheme)()
    result = quant.quantize_cache(header.manifest, fmt.load_tensors(header), quantizer)
    return fmt.write_artifact(target, result.manifest, result.tensors)


# -- output ---------------------------------------------------------------------------------------


def default_csv_path(model: str) -> Path:
    return command_dir("benchmark") / f"{int(time.time() * 1000)}-{model_slug(model)}-bench.csv"


def csv_text(rows: list[BenchRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow(row.csv_values())
    return out.getvalue()


def write_csv(rows: list[BenchRow], path: Path) -> Path:
    """Write the CSV atomically (temp file in the same directory, fsync, rename)."""
    from kvcdn_core.atomic import atomic_write_stream

    atomic_write_stream(Path(path), io.BytesIO(csv_text(rows).encode("utf-8")))
    return Path(path)


def table(rows: list[BenchRow]) -> str:
    head = (
        "tokens",
        "scheme",
        "prefill_s",
        "kv_attn_s",
        "load_s",
        "ttft_cached_s",
        "speedup_ttft",
        "kv_MB",
        "file_MB",
        "load_GB/s",
        "read_GB/s",
        "first_tok",
        "load/read",
        "ttft_pipelined_s",
        "limit_s",
        "speedup_pipelined",
    )
    lines = [head]
    for r in rows:
        lines.append(
            (
                str(r.tokens),
                r.scheme,
                f"{r.prefill_s:.4f}",
                f"{r.kv_attn_s:.4f}",
                f"{r.load_s:.4f}",
                f"{r.ttft_cached_s:.4f}",
                _times(r.speedup_ttft),
                f"{r.kv_mb:.2f}",
                f"{r.artifact_bytes / 1e6:.2f}",
                f"{r.load_gbps:.2f}",
                f"{r.plain_read_gbps:.2f}",
                {True: "same", False: "DIFFERS", None: "-"}[r.first_token_match],
                f"{r.load_read_ratio:.2f}x",
                f"{r.ttft_pipelined_s:.4f}",
                f"{r.ttft_limit_s:.4f}",
                _times(r.speedup_pipelined),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def _times(ratio: float) -> str:
    """A speed-up with two significant digits, so that a slow-down reads 0.42x, not 0.0x."""
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2g}x"


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
