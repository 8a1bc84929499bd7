"""A benchmark run as the user sees it: the CSV (documented columns, written atomically), the
table and summary lines, and the JSON document of ``--format json``."""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Any

from kvcdn_core.benchmark.result import BenchResult, BenchRow
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
    "model",
)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def csv_values(row: BenchRow) -> list[str]:
    return [_fmt(getattr(row, name)) for name in CSV_COLUMNS]


def row_dict(row: BenchRow) -> dict[str, Any]:
    """A row for ``--format json``: the CSV columns plus what the CSV leaves out."""
    data = {name: getattr(row, name) for name in CSV_COLUMNS}
    data.update(
        plain_read_gbps=round(row.plain_read_gbps, 4),
        load_unverified_s=row.load_unverified_s,
        first_token_match=row.first_token_match,
        spread={name: list(values) for name, values in row.spread.items()},
    )
    return data


def default_csv_path(model: str) -> Path:
    return command_dir("benchmark") / f"{int(time.time() * 1000)}-{model_slug(model)}-bench.csv"


def csv_text(rows: list[BenchRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow(csv_values(row))
    return out.getvalue()


def write_csv(rows: list[BenchRow], path: Path) -> Path:
    """Write the CSV atomically (temp file in the same directory, fsync, rename)."""
    from kvcdn_core.atomic import atomic_write_stream

    atomic_write_stream(Path(path), io.BytesIO(csv_text(rows).encode("utf-8")))
    return Path(path)


def as_json(result: BenchResult, session, reps: int, csv_path: Path) -> dict[str, Any]:
    """The ``--format json`` document of a run."""
    return {
        "csv": str(csv_path),
        "model": session.model_ref,
        "device": session.device,
        "dtype": session.dtype,
        "reps": reps,
        "threads": result.threads,
        "load_average": result.load_average,
        "context": result.context_source,
        "page_cache": result.page_cache,
        "page_cache_method": result.page_cache_method,
        "max_resident_after_drop": result.max_resident_after_drop,
        "rows": [row_dict(row) for row in result.rows],
    }


def summary(result: BenchResult, session, reps: int, csv_path: Path, wide: bool = False) -> str:
    """The table and the lines that say how it was measured (threads, load, context, page cache)."""
    start_load, end_load = result.load_average or (None, None)
    busy = f"; 1-minute load average {start_load} at the start, {end_load} at the end" if start_load is not None else ""
    return "\n".join(
        [
            table(result.rows, wide),
            f"model: {session.model_ref} ({session.device}, {session.dtype}); "
            f"medians of {reps} run(s) after one discarded warm-up",
            f"threads: {result.threads}{busy}",
            f"context: {result.context_source}",
            f"page cache: {result.page_cache}",
            f"wrote {csv_path}",
        ]
    )


def warnings(rows: list[BenchRow]) -> list[str]:
    """An unquantized artifact that continues differently from the resident cache is a bug: the
    warnings to report (the command shows each as `warning: ...`)."""
    return [
        f"at {row.tokens} tokens the loaded artifact's first token differs from the "
        "resident cache's; run `kvcdn verify`"
        for row in rows
        if row.scheme == "none" and row.first_token_match is False
    ]


#: The narrow table's columns (within 100 characters): header → the cell of a row.
NARROW = {
    "tokens": lambda r: str(r.tokens),
    "scheme": lambda r: r.scheme,
    "prefill_s": lambda r: f"{r.prefill_s:.4f}",
    "load_s": lambda r: f"{r.load_s:.4f}",
    "ttft_s": lambda r: f"{r.ttft_cached_s:.4f}",
    "speedup": lambda r: _times(r.speedup_ttft),
    "pipelined_s": lambda r: f"{r.ttft_pipelined_s:.4f}",
    "speedup_pipe": lambda r: _times(r.speedup_pipelined),
    "first_tok": lambda r: _first_token(r),
}
#: The wide table (``--wide``): every measured column, named as in the CSV.
WIDE = {
    "tokens": lambda r: str(r.tokens),
    "scheme": lambda r: r.scheme,
    "prefill_s": lambda r: f"{r.prefill_s:.4f}",
    "kv_attn_s": lambda r: f"{r.kv_attn_s:.4f}",
    "load_s": lambda r: f"{r.load_s:.4f}",
    "ttft_cached_s": lambda r: f"{r.ttft_cached_s:.4f}",
    "speedup_ttft": lambda r: _times(r.speedup_ttft),
    "kv_MB": lambda r: f"{r.kv_mb:.2f}",
    "file_MB": lambda r: f"{r.artifact_bytes / 1e6:.2f}",
    "load_GB/s": lambda r: f"{r.load_gbps:.2f}",
    "read_GB/s": lambda r: f"{r.plain_read_gbps:.2f}",
    "first_tok": lambda r: _first_token(r),
    "load/read": lambda r: f"{r.load_read_ratio:.2f}x",
    "ttft_pipelined_s": lambda r: f"{r.ttft_pipelined_s:.4f}",
    "limit_s": lambda r: f"{r.ttft_limit_s:.4f}",
    "speedup_pipelined": lambda r: _times(r.speedup_pipelined),
}


def table(rows: list[BenchRow], wide: bool = False) -> str:
    """The measurements, one row per length and scheme: the main columns, or all with ``wide``.

    Narrow names: ``ttft_s`` is ``ttft_cached_s``, ``speedup`` is ``speedup_ttft``, ``pipelined_s``
    ``ttft_pipelined_s`` and ``speedup_pipe`` ``speedup_pipelined`` (the CSV and JSON keep every column)."""
    columns = WIDE if wide else NARROW
    lines = [tuple(columns), *(tuple(cell(r) for cell in columns.values()) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def _first_token(row: BenchRow) -> str:
    return {True: "same", False: "DIFFERS", None: "-"}[row.first_token_match]


def _times(ratio: float) -> str:
    """A speed-up with two significant digits, so that a slow-down reads 0.42x, not 0.0x."""
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2g}x"
