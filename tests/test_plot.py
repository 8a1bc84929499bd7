"""kvcdn plot: break-even arithmetic, the 840x600 PNG, defaults and refusals (no model needed)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from kvcdn_core.benchmark import plot

HEADER = (
    "tokens,prefill_s,kv_attn_s,kv_mb,prefill_gflops,speedup_compute,"
    "scheme,load_s,load_gbps,ttft_cached_s,speedup_ttft,artifact_bytes\n"
)


def write_csv(path, rows):
    path.write_text(
        HEADER
        + "".join(
            f"{tokens},{prefill},0.01,10,5,{prefill / 0.01},{scheme},{load},1.0,{load + 0.01},{prefill / (load + 0.01)},1000\n"
            for tokens, scheme, prefill, load in rows
        )
    )
    return path


def test_break_even_arithmetic():
    assert plot.break_even(10.0, 2.0) == 1.25  # 10 / (10 - 2)
    assert plot.break_even(3.0, 0.5) == pytest.approx(1.2)  # 3 / 2.5
    assert plot.break_even(4.0, 3.0) == 4.0  # 4 / 1
    assert math.isinf(plot.break_even(1.0, 1.0)) and math.isinf(plot.break_even(1.0, 2.0))
    cost = plot.Cost(512, "none", 10.0, 2.0)
    assert cost.amortized(4) == 4.5  # 10/4 + 2
    assert cost.amortized(cost.n_star) == pytest.approx(10.0)  # the curves meet at N*
    assert cost.saving(100) == pytest.approx(1 - 2.1 / 10)  # (10/100 + 2) against 10


def test_plot_png_and_table(cli, tmp_path):
    csv_path = write_csv(
        tmp_path / "b.csv",
        [(512, "none", 10.0, 2.0), (2048, "none", 40.0, 0.5), (2048, "int8", 40.0, 0.3), (64, "none", 0.1, 0.2)],
    )
    out = tmp_path / "chart.png"
    result = cli("plot", "--csv-path", csv_path, "--output", out, "--max-n", "100", "--model", "Qwen/Qwen3-0.6B")
    assert result.exit_code == 0, result.stderr
    data = out.read_bytes()
    assert plot.png_size(data) == (840, 600)
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["tokens", "scheme", "C_prefill_s", "C_load_s", "N*", "saving@N=100"]
    assert lines[1].split() == ["64", "none", "0.1000", "0.2000", "never", "-101.0%"]  # 1 - (0.1/100 + 0.2) / 0.1
    assert lines[2].split() == ["512", "none", "10.0000", "2.0000", "1.250", "79.0%"]
    assert lines[3].split()[:5] == ["2048", "none", "40.0000", "0.5000", "1.013"]  # 40 / 39.5
    assert lines[4].split()[:2] == ["2048", "int8"]

    result = cli("plot", "--csv-path", csv_path, "--output", out, "--format", "json", "--force")
    rows = json.loads(result.stdout)["rows"]
    assert rows[1]["n_star"] == 1.25 and rows[0]["n_star"] is None
    assert rows[1]["saving_at_max_n"] == pytest.approx(1 - (10 / 1000 + 2) / 10)


def test_defaults_pick_the_newest_csv_and_a_timestamped_png(cli, tmp_path):
    folder = tmp_path / "xdg-data" / "kvcdn" / "benchmark"
    folder.mkdir(parents=True)
    old = write_csv(folder / "1000-m_a-bench.csv", [(100, "none", 1.0, 0.5)])
    new = write_csv(folder / "2000-m_a-bench.csv", [(200, "none", 3.0, 1.0)])
    os.utime(old, (1, 1))
    result = cli("plot")
    assert result.exit_code == 0, result.stderr
    assert f"read {new}" in result.stdout and "1.500" in result.stdout  # 3 / (3 - 1)
    (png,) = (tmp_path / "xdg-data" / "kvcdn" / "plot").glob("*.png")
    stamp, _, rest = png.name.partition("-")
    assert stamp.isdigit() and rest == "m_a-amortized-cost.png"


@pytest.mark.parametrize(
    "content, message",
    [
        ("a,b\n1,2\n", "not a benchmark CSV: missing column(s) tokens, prefill_s, load_s"),
        (HEADER, "has a header but no rows"),
        (HEADER + "512,abc,0,0,0,0,none,1,0,0,0,0\n", "line 2: prefill_s 'abc' is not a number"),
        (HEADER + "512,0,0,0,0,0,none,1,0,0,0,0\n", "line 2: prefill_s must be a positive number of seconds"),
        (HEADER + "512,2,0,0,0,0,none,-1,0,0,0,0\n", "line 2: load_s must be a positive number of seconds"),
        (HEADER + "-5,2,0,0,0,0,none,1,0,0,0,0\n", "tokens must be a positive number of tokens"),
        ("", "missing column(s)"),
    ],
)
def test_invalid_csvs_are_refused(cli, tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    result = cli("plot", "--csv-path", path, "--output", tmp_path / "x.png")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert not (tmp_path / "x.png").exists()


def test_other_refusals(cli, tmp_path):
    csv_path = write_csv(tmp_path / "b.csv", [(512, "none", 10.0, 2.0)])
    result = cli("plot", "--csv-path", csv_path, "--max-n", "1", "--output", tmp_path / "x.png")
    assert result.exit_code == 2 and "--max-n must be at least 2" in result.stderr
    result = cli("plot", "--csv-path", tmp_path / "missing.csv")
    assert result.exit_code == 2 and "does not exist" in result.stderr
    result = cli("plot")  # empty data directory
    assert result.exit_code == 2 and "no benchmark CSV" in result.stderr and "kvcdn benchmark" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_plot_needs_no_torch_and_no_display(tmp_path):
    csv_path = write_csv(tmp_path / "b.csv", [(512, "none", 10.0, 2.0)])
    out = tmp_path / "p.png"
    probe = (
        "import sys\nfrom kvcdn_core.cli.app import main\n"
        f"try:\n    main(['plot', '--csv-path', {str(csv_path)!r}, '--output', {str(out)!r}])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('HEAVY=' + ','.join(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY=\n" in proc.stdout
    assert plot.png_size(out.read_bytes()) == (840, 600)


def clustered_costs():
    """Break-evens that cluster near N=1 (what a fast disk gives), and one that never comes."""
    return [
        plot.Cost(256, "none", 0.10, 0.020),
        plot.Cost(256, "int8", 0.10, 0.018),
        plot.Cost(512, "none", 0.105, 0.021),
        plot.Cost(512, "int8", 0.105, 0.02),
        plot.Cost(1024, "none", 0.11, 0.02),
        plot.Cost(1024, "int8", 0.11, 0.2),
        plot.Cost(64, "none", 0.002, 0.0015),
    ]


def test_no_label_can_overlap_a_curve_and_never_is_shown():
    """N* values live in the legend, below the axes: nothing is written over the curves."""
    fig = plot.render_figure(clustered_costs(), 1000, "title")
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    assert len(ax.texts) == 0 and ax.get_legend() is None
    (legend,) = fig.legends
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    labels = [t.get_text() for t in legend.get_texts()]
    assert "1024 tokens: N* 1.22 (none), never (int8)" in labels
    assert "256 tokens: N* 1.25 (none), 1.22 (int8)" in labels
    # the curve that never breaks even is inside the y range, not cut off above it
    assert ax.get_ylim()[1] > 0.2


def test_n_star_beyond_the_axis_is_said():
    assert plot.n_star_text(plot.Cost(64, "none", 1.0, 0.9995), 100) == "> 100"


def test_title_names_the_model_from_the_option_the_csv_or_the_file(cli, tmp_path):
    def titled(csv_path, *args):
        result = cli(
            "plot",
            "--csv-path",
            csv_path,
            "--output",
            tmp_path / f"{csv_path.stem}{len(args)}.png",
            "--format",
            "json",
            *args,
        )
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["title"]

    plain = write_csv(tmp_path / "bench.csv", [(128, "none", 0.2, 0.05)])
    named = write_csv(tmp_path / "1700000000000-Qwen_Qwen3-0.6B-bench.csv", [(128, "none", 0.2, 0.05)])
    column = tmp_path / "column.csv"
    column.write_text("tokens,prefill_s,load_s,model\n128,0.2,0.05,Qwen/Qwen3-0.6B\n")
    assert titled(plain).endswith("\nbench.csv")  # at least which data it is
    assert titled(plain, "--model", "./tiny-qwen3").endswith("\n./tiny-qwen3")
    assert titled(named).endswith("\nQwen_Qwen3-0.6B")
    assert titled(column).endswith("\nQwen/Qwen3-0.6B")


def test_a_local_model_path_gives_a_sane_default_name(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    csv_path = write_csv(tmp_path / "bench.csv", [(128, "none", 0.2, 0.05)])
    result = cli("plot", "--csv-path", csv_path, "--model", "./tiny-qwen3")
    assert result.exit_code == 0, result.stderr
    (png,) = (tmp_path / "xdg-data" / "kvcdn" / "plot").glob("*.png")
    assert png.name.endswith("-tiny-qwen3-amortized-cost.png"), png.name


def test_a_prefill_slower_at_fewer_tokens_is_flagged(cli, tmp_path):
    """A 64-token prefill slower than a 128-token one is noise; the plot says so instead of drawing it quietly."""
    csv_path = write_csv(
        tmp_path / "noisy.csv", [(64, "none", 0.5, 0.05), (128, "none", 0.3, 0.06), (256, "none", 0.9, 0.1)]
    )
    result = cli("plot", "--csv-path", csv_path, "--output", tmp_path / "noisy.png", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert "warning: prefill at 64 tokens (0.5 s) took longer than at 128 tokens (0.3 s)" in result.stderr
    data = json.loads(result.stdout)
    assert len(data["non_monotonic"]) == 1 and "64 tokens" in data["non_monotonic"][0]
    quiet = write_csv(tmp_path / "quiet.csv", [(64, "none", 0.2, 0.05), (128, "none", 0.3, 0.06)])
    result = cli("plot", "--csv-path", quiet, "--output", tmp_path / "quiet.png", "--format", "json")
    assert "took longer" not in result.stderr and json.loads(result.stdout)["non_monotonic"] == []


def test_the_old_out_spelling_works_one_release_with_a_warning(cli, tmp_path):
    csv_path = write_csv(tmp_path / "b.csv", [(512, "none", 10.0, 2.0)])
    result = cli("plot", "--csv-path", csv_path, "--out", tmp_path / "old.png")
    assert result.exit_code == 0, result.stderr
    assert "warning: plot --out is deprecated; use --output (-o)" in result.stderr
    assert (tmp_path / "old.png").is_file()
