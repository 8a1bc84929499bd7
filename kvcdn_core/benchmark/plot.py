"""Where reuse pays off: amortized cost per call against the number of calls sharing one context.

Without a cache every call pays the prefill, ``C_prefill``. With one, the prefill is paid once and
each of N calls loads the artifact: ``C_prefill / N + C_load`` per call. The two meet at the
break-even reuse count ``N* = C_prefill / (C_prefill - C_load)``; past it the cache is cheaper, and
the saving tends to ``1 - C_load / C_prefill``. The costs come from a ``kvcdn benchmark`` CSV.

matplotlib is imported lazily and only its Agg canvas is used: no display, no system fonts.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import time
from pathlib import Path

from kvcdn_core.errors import KvcdnError
from kvcdn_core.paths import command_dir, model_slug

REQUIRED_COLUMNS = ("tokens", "prefill_s", "load_s")
WIDTH_PX, HEIGHT_PX, DPI = 840, 600, 100
DEFAULT_MAX_N = 1000


@dataclasses.dataclass
class Cost:
    """One curve: a context length (and scheme) with its measured costs in seconds."""

    tokens: int
    scheme: str
    c_prefill: float
    c_load: float

    @property
    def n_star(self) -> float:
        return break_even(self.c_prefill, self.c_load)

    def amortized(self, n: float) -> float:
        return amortized_cost(self.c_prefill, self.c_load, n)

    def saving(self, n: float) -> float:
        """Fraction of the uncached cost saved per call at N calls (negative: caching loses)."""
        return 1 - self.amortized(n) / self.c_prefill

    def as_dict(self, max_n: int) -> dict:
        n_star = self.n_star
        return {
            "tokens": self.tokens,
            "scheme": self.scheme,
            "c_prefill": self.c_prefill,
            "c_load": self.c_load,
            "n_star": None if math.isinf(n_star) else n_star,
            "saving_at_max_n": self.saving(max_n),
        }


def break_even(c_prefill: float, c_load: float) -> float:
    """``N* = C_prefill / (C_prefill - C_load)``; infinity when loading is not cheaper than prefill."""
    if c_load >= c_prefill:
        return math.inf
    return c_prefill / (c_prefill - c_load)


def amortized_cost(c_prefill: float, c_load: float, n: float) -> float:
    return c_prefill / n + c_load


def read_costs(path: str | Path) -> list[Cost]:
    """The costs in a benchmark CSV; anything malformed is refused with the row and column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvcdnError(f"CSV '{path}' does not exist") from None
    except IsADirectoryError:
        raise KvcdnError(f"CSV '{path}' is a directory") from None
    except UnicodeDecodeError:
        raise KvcdnError(f"'{path}' is not a benchmark CSV: not UTF-8 text") from None
    reader = csv.DictReader(io.StringIO(text))
    columns = reader.fieldnames or []
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise KvcdnError(
            f"'{path}' is not a benchmark CSV: missing column(s) {', '.join(missing)} "
            f"(write one with `kvcdn benchmark`)"
        )
    costs = []
    for line, row in enumerate(reader, start=2):
        values = {}
        for column in REQUIRED_COLUMNS:
            raw = (row.get(column) or "").strip()
            try:
                values[column] = float(raw)
            except ValueError:
                raise KvcdnError(f"{path}: line {line}: {column} {raw!r} is not a number") from None
            if not math.isfinite(values[column]) or values[column] <= 0:
                raise KvcdnError(
                    f"{path}: line {line}: {column} must be a positive number of "
                    f"{'tokens' if column == 'tokens' else 'seconds'}, got {raw}"
                )
        if values["tokens"] != int(values["tokens"]):
            raise KvcdnError(f"{path}: line {line}: tokens {row['tokens']!r} is not a whole number")
        costs.append(
            Cost(
                int(values["tokens"]),
                (row.get("scheme") or "none").strip() or "none",
                values["prefill_s"],
                values["load_s"],
            )
        )
    if not costs:
        raise KvcdnError(f"'{path}' has a header but no rows")
    return sorted(costs, key=lambda c: (c.tokens, c.scheme != "none", c.scheme))


def non_monotonic(costs: list[Cost]) -> list[str]:
    """Lines for prefills that took longer at fewer tokens: a prefill costs more with every token,
    so such a pair is noise in the measurement (a busy machine), not a property of the model."""
    prefill = {c.tokens: c.c_prefill for c in costs if c.scheme == "none"} or {c.tokens: c.c_prefill for c in costs}
    lengths = sorted(prefill)
    return [
        f"prefill at {a} tokens ({prefill[a]:.4g} s) took longer than at {b} tokens ({prefill[b]:.4g} s): "
        "a noisy measurement; run the benchmark again with more --reps on a quieter machine"
        for a, b in zip(lengths, lengths[1:])
        if prefill[a] > prefill[b]
    ]


def check_max_n(max_n: int) -> None:
    if max_n < 2:
        raise KvcdnError(f"--max-n must be at least 2 (reuse means two calls or more), got {max_n}")


def newest_csv(model: str | None = None) -> Path:
    """The newest benchmark CSV in the data directory (of ``model``, when given)."""
    folder = command_dir("benchmark")
    pattern = f"*-{model_slug(model)}-bench.csv" if model else "*-bench.csv"
    found = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    if not found:
        who = f" for model '{model}'" if model else ""
        raise KvcdnError(f"no benchmark CSV{who} in {folder}; run `kvcdn benchmark` or pass --csv-path")
    return found[-1]


def model_in_csv(path: Path) -> str | None:
    """The model a benchmark CSV names: its ``model`` column if it has one, else its default file name."""
    with path.open(encoding="utf-8", newline="") as f:
        row = next(csv.DictReader(f), None) or {}
    return (row.get("model") or "").strip() or model_from_csv_name(path)


def model_from_csv_name(path: Path) -> str | None:
    """``<ms>-<model slug>-bench.csv`` → the model slug, for titles and default names."""
    stem = path.name
    if not stem.endswith("-bench.csv"):
        return None
    head, _, rest = stem[: -len("-bench.csv")].partition("-")
    return rest if head.isdigit() and rest else None


def default_png_path(model: str | None) -> Path:
    name = f"{int(time.time() * 1000)}-{model_slug(model) if model else 'bench'}-amortized-cost.png"
    return command_dir("plot") / name


def table(costs: list[Cost], max_n: int) -> str:
    head = ("tokens", "scheme", "C_prefill_s", "C_load_s", "N*", f"saving@N={max_n}")
    lines = [head]
    for c in costs:
        n_star = c.n_star
        lines.append(
            (
                str(c.tokens),
                c.scheme,
                f"{c.c_prefill:.4f}",
                f"{c.c_load:.4f}",
                "never" if math.isinf(n_star) else f"{n_star:.3f}",
                f"{c.saving(max_n):.1%}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def n_star_text(cost: Cost, max_n: int) -> str:
    """N* for a legend entry: a number, "> max_n" when off the chart, or "never"."""
    if math.isinf(cost.n_star):
        return "never"
    return f"{cost.n_star:.2f}" if cost.n_star <= max_n else f"> {max_n}"


def render_png(costs: list[Cost], max_n: int, title: str) -> bytes:
    """The 840x600 log-log chart as PNG bytes."""
    from matplotlib import rc_context

    with rc_context(STYLE):
        fig = render_figure(costs, max_n, title)
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=DPI)
    return out.getvalue()


STYLE = {"font.family": "DejaVu Sans", "font.size": 10}


def render_figure(costs: list[Cost], max_n: int, title: str):
    """The chart as a matplotlib Figure (Agg canvas).

    Nothing is written inside the axes but curves and N* markers: the N* values (also "never")
    are in the legend, which sits below the axes, so no label can cover a curve or another label.
    """
    import numpy as np
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    n = np.geomspace(1, max_n, 256)
    lengths = sorted({c.tokens for c in costs})
    schemes = sorted({c.scheme for c in costs}, key=lambda s: (s != "none", s))
    styles = ["-", "-.", ":", (0, (5, 1, 1, 1)), (0, (1, 1))]
    with rc_context(STYLE):
        fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        colors = [f"C{i % 10}" for i in range(len(lengths))]
        # One marker shape per scheme: break-even points of one length share its prefill cost (the
        # same height) and often sit near N = 1 together, so shapes keep them apart to the eye.
        shapes = ["o", "s", "^", "D", "v", "P"]
        handles = []
        for length, color in zip(lengths, colors):
            group = [c for c in costs if c.tokens == length]
            ax.plot(n, np.full_like(n, group[0].c_prefill), linestyle="--", color=color, alpha=0.55, lw=1.2)
            for c in group:
                style = styles[schemes.index(c.scheme) % len(styles)]
                ax.plot(n, c.c_prefill / n + c.c_load, linestyle=style, color=color, lw=1.8)
                if not math.isinf(c.n_star) and c.n_star <= max_n:
                    # N* is always above 1, often just above: do not let the axis clip the marker.
                    ax.plot(
                        [c.n_star],
                        [c.c_prefill],
                        marker=shapes[schemes.index(c.scheme) % len(shapes)],
                        ms=7 - 1.5 * (schemes.index(c.scheme) % 3),
                        color=color,
                        markeredgecolor="black",
                        zorder=5,
                        clip_on=False,
                    )
            stars = ", ".join(n_star_text(c, max_n) + (f" ({c.scheme})" if len(schemes) > 1 else "") for c in group)
            handles.append(Line2D([], [], color=color, lw=1.8, label=f"{length} tokens: N* {stars}"))
        handles.append(
            Line2D([], [], color="gray", lw=1.2, linestyle="--", alpha=0.8, label="no cache: C_prefill every call")
        )
        for scheme in schemes:
            style = styles[schemes.index(scheme) % len(styles)]
            label = "cached" if scheme == "none" else f"cached, {scheme}"
            handles.append(
                Line2D([], [], color="gray", lw=1.8, linestyle=style, label=f"{label}: C_prefill/N + C_load")
            )
        handles.append(
            Line2D(
                [],
                [],
                color="gray",
                marker="o",
                markeredgecolor="black",
                lw=0,
                label="break-even N* = C_prefill/(C_prefill - C_load); never: load >= prefill",
            )
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(1, max_n)
        # Room for every flat line, and for a cached curve that never breaks even (load >= prefill).
        ax.set_ylim(min(c.c_load for c in costs) / 1.5, max(max(c.c_prefill, c.c_load) for c in costs) * 1.5)
        ax.set_xlabel("reuse count N (calls that share one cached context)")
        ax.set_ylabel("amortized cost per call (seconds)")
        ax.set_title(title, fontsize=11)
        ax.grid(True, which="both", alpha=0.25)
        rows = math.ceil(len(handles) / 2)
        legend_height = 0.035 * rows + 0.03
        fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, framealpha=0.9, bbox_to_anchor=(0.5, 0.005))
        fig.subplots_adjust(left=0.1, right=0.97, top=0.9, bottom=0.1 + legend_height)
    return fig


def write_png(data: bytes, path: Path) -> Path:
    """Write atomically (temp file in the same directory, fsync, rename)."""
    from kvcdn_core.atomic import atomic_write_stream

    atomic_write_stream(Path(path), io.BytesIO(data))
    return Path(path)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
