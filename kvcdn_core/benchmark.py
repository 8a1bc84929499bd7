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
import ctypes
import ctypes.util
import dataclasses
import io
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from kvcdn_core.errors import KvcdnError
from kvcdn_core.paths import command_dir, model_slug

#: CSV columns, in the documented order: the compute group, then the per-scheme group.
CSV_COLUMNS = (
    "tokens", "prefill_s", "kv_attn_s", "kv_mb", "prefill_gflops", "speedup_compute",
    "scheme", "load_s", "load_gbps", "ttft_cached_s", "speedup_ttft", "artifact_bytes",
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
    plain_read_s: float = 0.0
    load_unverified_s: float = 0.0  # the same load without the sha256 check: what hashing costs
    first_token_match: bool | None = None

    @property
    def plain_read_gbps(self) -> float:
        return self.artifact_bytes / self.plain_read_s / 1e9 if self.plain_read_s > 0 else 0.0

    def csv_values(self) -> list[str]:
        return [_fmt(getattr(self, name)) for name in CSV_COLUMNS]

    def as_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in CSV_COLUMNS}
        data.update(plain_read_s=self.plain_read_s, plain_read_gbps=round(self.plain_read_gbps, 4),
                    load_unverified_s=self.load_unverified_s, first_token_match=self.first_token_match)
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
                raise KvcdnError("cannot write /proc/sys/vm/drop_caches (needs root on Linux); "
                                 "use --page-cache file")
        if self.method != "drop_caches":
            self.method = "fadvise" if _fadvise_dontneed(path) else "none"
        resident = resident_fraction(path)
        if resident is not None:
            self.max_resident = max(self.max_resident or 0.0, resident)

    def describe(self) -> str:
        if self.method in (None, "none"):
            return "warm: the page cache was not dropped, loads may read from memory"
        how = ("/proc/sys/vm/drop_caches (sync, then 1)" if self.method == "drop_caches"
               else "posix_fadvise(DONTNEED) on the artifact")
        if self.max_resident is None:
            return f"dropped before each load with {how} (residency not checkable here)"
        if self.max_resident > COLD_RESIDENCY:
            return (f"NOT cold: after {how} up to {self.max_resident:.0%} of the file stayed "
                    "in the page cache (a tmpfs or a file system that ignores the drop)")
        return f"dropped before each load with {how}; at most {self.max_resident:.0%} of the file stayed resident"


def _drop_system_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def _fadvise_dontneed(path: Path) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float | None:
    """The fraction of ``path``'s pages in the page cache (Linux ``mincore``), or None if unknown."""
    if not sys.platform.startswith("linux"):
        return None
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return (pages - bytes(vec).count(0)) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def plain_read(path: Path) -> int:
    """Read a whole file into memory the simplest fast way: the physical limit a load is held to.

    Same buffer as :func:`kvcdn_core.artifact.load_tensors` (uninitialised numpy, huge pages where
    offered), so the two differ only by what loading adds: hashing, tensor views, the cache.
    """
    import numpy as np

    size = os.path.getsize(path)
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer)
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
            raise KvcdnError(f"the context file has {len(ids)} tokens, --lengths needs {longest}; "
                             "pass a longer file or smaller lengths")
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


def _median_run(fn: Callable[[], Any], reps: int, tick: Callable[[], None], warmup=None) -> tuple[float, Any]:
    """One warm-up (``warmup`` or ``fn``), then ``reps`` timed calls of ``fn``; ``(median s, last)``."""
    (warmup or fn)()
    tick()
    times, last = [], None
    for _ in range(reps):
        start = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - start)
        tick()
    return statistics.median(times), last


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


def run_benchmark(session, ids: list[int], lengths: list[int], reps: int, schemes: list[str],
                  workdir: Path, question: str, page_cache: PageCache, context_source: str,
                  progress: bool = True) -> BenchResult:
    """Measure every length and scheme; artifacts are written under ``workdir`` and removed."""
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
    device = session.device
    per_length = (2 + len(schemes)) * (reps + 1)  # prefill, one step, a load per scheme
    rows: list[BenchRow] = []
    workdir.mkdir(parents=True, exist_ok=True)

    def forward(cache, piece):
        out, cache = session.adapter.forward(session.model, runtime._ids_tensor(session, piece), cache)
        return int(torch.argmax(out[0, -1])), cache

    with torch.inference_mode(), Progress(per_length * len(lengths), "benchmark", unit="runs",
                                          enabled=progress) as bar:
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

            prefill_s, (cache, first) = _median_run(full_prefill, reps, tick, warmup=counted_prefill)
            total_flops = flops["matmul"] + attention_flops(session.model.config, length)

            def one_step():
                resident = copy.deepcopy(cache)
                _sync(device)
                start = time.perf_counter()
                forward(resident, [first])
                _sync(device)
                return time.perf_counter() - start

            one_step()
            tick()
            steps = []
            for _ in range(reps):
                steps.append(one_step())
                tick()
            kv_attn_s = statistics.median(steps)
            # The reference for the loaded caches: the question continued on the resident cache
            # the artifact is saved from; a loaded unquantized artifact must give the same token.
            expected, _ = forward(copy.deepcopy(cache), question_ids)

            base = runtime.save_cache(session, cache, ctx, runtime.decode(session, ctx),
                                      workdir / f"bench-{length}-none.kv")
            del cache
            header = fmt.read_header(base)
            kv_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0]
                           for name, e in header.entries.items() if name != fmt.TOKEN_IDS)
            compute = dict(tokens=length, prefill_s=prefill_s, kv_attn_s=kv_attn_s,
                           kv_mb=kv_bytes / 1e6, prefill_gflops=total_flops / 1e9 / prefill_s,
                           speedup_compute=prefill_s / kv_attn_s)
            for scheme in schemes:
                path = base if scheme == "none" else quantize(base, scheme, workdir / f"bench-{length}-{scheme}.kv")
                rows.append(_measure_load(session, path, scheme, question_ids, expected, reps,
                                          page_cache, tick, forward, compute))
                if path != base:
                    path.unlink(missing_ok=True)
            base.unlink(missing_ok=True)
    return BenchResult(rows, page_cache.describe(), page_cache.method or "none",
                       page_cache.max_resident, context_source)


def _measure_load(session, path: Path, scheme: str, question_ids, expected: int, reps: int,
                  page_cache: PageCache, tick, forward, compute: dict) -> BenchRow:
    from kvcdn_core import artifact as fmt
    from kvcdn_core import runtime

    size = path.stat().st_size
    loads, ttfts, reads, unverified, tokens = [], [], [], [], []
    for rep in range(reps + 1):
        page_cache.drop(path)
        start = time.perf_counter()
        plain_read(path)
        read_s = time.perf_counter() - start
        page_cache.drop(path)
        start_load = time.perf_counter()
        header = fmt.read_header(path)
        cache, _ = runtime.load_cache(session, header)
        _sync(session.device)
        loaded = time.perf_counter()
        token, cache = forward(cache, question_ids)
        _sync(session.device)
        done = time.perf_counter()
        del cache
        page_cache.drop(path)
        start = time.perf_counter()
        cache, _ = runtime.load_cache(session, fmt.read_header(path), verify_hashes=False)
        _sync(session.device)
        unverified_s = time.perf_counter() - start
        del cache
        tokens.append(token)
        if rep:  # rep 0 is the warm-up
            loads.append(loaded - start_load)
            ttfts.append(done - start_load)
            reads.append(read_s)
            unverified.append(unverified_s)
        tick()
    load_s, ttft_s = statistics.median(loads), statistics.median(ttfts)
    return BenchRow(
        **compute, scheme=scheme, load_s=load_s, load_gbps=size / load_s / 1e9,
        ttft_cached_s=ttft_s, speedup_ttft=compute["prefill_s"] / ttft_s, artifact_bytes=size,
        plain_read_s=statistics.median(reads), load_unverified_s=statistics.median(unverified),
        first_token_match=all(t == expected for t in tokens),
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
    head = ("tokens", "scheme", "prefill_s", "kv_attn_s", "load_s", "ttft_cached_s", "speedup_ttft",
            "kv_MB", "file_MB", "load_GB/s", "read_GB/s", "first_tok")
    lines = [head]
    for r in rows:
        lines.append((str(r.tokens), r.scheme, f"{r.prefill_s:.4f}", f"{r.kv_attn_s:.4f}", f"{r.load_s:.4f}",
                      f"{r.ttft_cached_s:.4f}", f"{r.speedup_ttft:.1f}x", f"{r.kv_mb:.2f}",
                      f"{r.artifact_bytes / 1e6:.2f}", f"{r.load_gbps:.2f}", f"{r.plain_read_gbps:.2f}",
                      {True: "same", False: "DIFFERS", None: "-"}[r.first_token_match]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


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
