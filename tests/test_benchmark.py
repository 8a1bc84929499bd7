"""kvcdn benchmark end to end on a tiny Qwen3: the CSV schema, measured sizes, cold loads, refusals."""

from __future__ import annotations

import csv
import json
import os
import statistics

import pytest

from kvcdn_core.artifact.pagecache import COLD_RESIDENCY, resident_fraction
from kvcdn_core.benchmark import inputs, timing
from kvcdn_core.benchmark.plot import png_size
from kvcdn_core.benchmark.result import TIMED
from kvcdn_core.cores import physical_cores
from kvcdn_core.errors import KvcdnError

EXPECTED_COLUMNS = [
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
    # added after the first twelve, which keep their places for older readers
    "plain_read_s",
    "load_read_ratio",
    "question_s",
    "ttft_pipelined_s",
    "ttft_limit_s",
    "speedup_pipelined",
    "threads",
    "model",
]


@pytest.fixture(scope="module")
def bench_run(qwen3_dir, tmp_path_factory):
    """One benchmark of the tiny model (32 and 64 tokens, none and int8), run as a user runs it."""
    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli

    out = tmp_path_factory.mktemp("bench") / "tiny-bench.csv"
    result = CliRunner().invoke(
        make_cli(),
        [
            "benchmark",
            "--model",
            str(qwen3_dir),
            "--lengths",
            "64,32",
            "--reps",
            "2",
            "--threads",
            "1",
            "--scheme",
            "none,int8",
            "--page-cache",
            "file",
            "--output",
            str(out),
            "--format",
            "json",
            "-q",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.stderr
    return out, json.loads(result.stdout)


def _kv_bytes(model_dir, tokens: int) -> int:
    """Bytes of a float32 full-attention cache, from the model's config (the hand computation)."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * tokens * 4


def test_csv_has_the_documented_columns_in_order(bench_run):
    path, _ = bench_run
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == EXPECTED_COLUMNS
    assert [(r[0], r[6]) for r in rows[1:]] == [("32", "none"), ("32", "int8"), ("64", "none"), ("64", "int8")]
    for row in rows[1:]:
        for column, value in zip(EXPECTED_COLUMNS, row):
            if column not in ("scheme", "model"):
                assert float(value) > 0, (column, value)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temp files or scratch left behind"


def test_measurements_are_consistent(bench_run, qwen3_dir):
    _, data = bench_run
    rows = {(r["tokens"], r["scheme"]): r for r in data["rows"]}
    for tokens in (32, 64):
        none, int8 = rows[(tokens, "none")], rows[(tokens, "int8")]
        # kv_mb is measured from the artifact; it must equal what the config says the cache holds.
        assert none["kv_mb"] == pytest.approx(_kv_bytes(qwen3_dir, tokens) / 1e6)
        assert none["artifact_bytes"] > _kv_bytes(qwen3_dir, tokens)  # plus header and token ids
        assert int8["artifact_bytes"] < none["artifact_bytes"]
        for row in (none, int8):
            assert row["tokens"] == tokens
            assert row["ttft_cached_s"] >= row["load_s"]
            assert row["speedup_ttft"] == pytest.approx(row["prefill_s"] / row["ttft_cached_s"])
            assert row["speedup_compute"] == pytest.approx(row["prefill_s"] / row["kv_attn_s"])
            assert row["load_gbps"] == pytest.approx(row["artifact_bytes"] / row["load_s"] / 1e9)
            assert row["prefill_gflops"] > 0
            assert row["plain_read_s"] > 0 and row["load_unverified_s"] > 0
            assert row["load_read_ratio"] == pytest.approx(row["load_s"] / row["plain_read_s"])
            assert row["ttft_limit_s"] == max(row["plain_read_s"], row["question_s"])
            assert row["speedup_pipelined"] == pytest.approx(row["prefill_s"] / row["ttft_pipelined_s"])
            assert row["threads"] == 1
            # min <= median <= max over the timed runs, per timed column
            for name in TIMED:
                low, mid, high = row["spread"][name]
                assert low <= mid <= high and mid == pytest.approx(row[name]), name
        # The unquantized artifact continues exactly like the resident cache (a full prefill's).
        assert none["first_token_match"] is True
        # The compute columns describe the length, not the scheme.
        assert none["prefill_s"] == int8["prefill_s"] and none["kv_mb"] == int8["kv_mb"]
    assert data["page_cache_method"] == "fadvise"
    assert "posix_fadvise" in data["page_cache"]
    if data["max_resident_after_drop"] is not None and data["max_resident_after_drop"] > COLD_RESIDENCY:
        assert data["page_cache"].startswith("NOT cold")
    assert data["context"].startswith("synthetic")
    assert data["threads"] == 1 and len(data["load_average"]) == 2


def test_benchmark_then_plot_with_defaults(cli, qwen3_dir, tmp_path):
    result = cli("benchmark", "--model", qwen3_dir, "--lengths", "16", "--reps", "1", "--page-cache", "keep", "-q")
    assert result.exit_code == 0, result.stderr
    folder = tmp_path / "xdg-data" / "kvcdn" / "benchmark"
    (csv_path,) = folder.glob("*-bench.csv")
    stamp, _, rest = csv_path.name.partition("-")
    assert stamp.isdigit() and rest.endswith("-bench.csv")
    assert f"wrote {csv_path}" in result.stdout
    assert "page cache: warm" in result.stdout
    assert "context: synthetic" in result.stdout and "prefill_s" in result.stdout
    assert f"threads: {physical_cores()}" in result.stdout  # the default, printed
    assert "pipelined_s" in result.stdout and "speedup_pipe" in result.stdout
    assert result.stdout.count("context: synthetic") == 1  # once, with how it was measured
    assert max(len(line) for line in result.stdout.splitlines()[:2]) <= 100

    result = cli("plot")  # the newest CSV in the data directory
    assert result.exit_code == 0, result.stderr
    (png,) = (tmp_path / "xdg-data" / "kvcdn" / "plot").glob("*-amortized-cost.png")
    assert png_size(png.read_bytes()) == (840, 600)
    assert f"read {csv_path}" in result.stdout and "N*" in result.stdout
    wide = cli(
        "benchmark", "--model", qwen3_dir, "--lengths", "16", "--reps", "1", "--page-cache", "keep", "-q", "--wide"
    )
    assert wide.exit_code == 0, wide.stderr
    assert "ttft_pipelined_s" in wide.stdout and "limit_s" in wide.stdout and "kv_attn_s" in wide.stdout


def test_context_file_and_its_length(cli, qwen3_dir, context_file, tmp_path):
    result = cli(
        "benchmark",
        "--model",
        qwen3_dir,
        "--lengths",
        "2000",
        "--context-file",
        context_file,
        "--output",
        tmp_path / "b.csv",
    )
    assert result.exit_code == 2
    assert "--lengths needs 2000" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "b.csv").exists()

    result = cli(
        "benchmark",
        "--model",
        qwen3_dir,
        "--lengths",
        "24",
        "--reps",
        "1",
        "--context-file",
        context_file,
        "--page-cache",
        "keep",
        "--output",
        tmp_path / "b.csv",
        "--format",
        "json",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["context"].startswith("context file")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scheme", "none,int7"], "unknown quantization scheme(s) int7; installed: none, "),
        (["--lengths", "a,b"], "--lengths must be comma-separated token counts"),
        (["--lengths", "0,32"], "--lengths must be positive"),
        (["--lengths", "999999"], "the model's context is"),
    ],
)
def test_refusals(cli, qwen3_dir, tmp_path, args, message):
    result = cli("benchmark", "--model", qwen3_dir, "--output", tmp_path / "b.csv", *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert not (tmp_path / "b.csv").exists()


def test_unknown_scheme_lists_the_installed_ones():
    with pytest.raises(KvcdnError) as info:
        inputs.parse_schemes("none,int8,zz", ["fp8", "int8"])
    assert str(info.value) == "unknown quantization scheme(s) zz; installed: none, fp8, int8"
    assert inputs.parse_schemes("none, int8,none", ["int8"]) == ["none", "int8"]


def test_resident_fraction_sees_a_read_file(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    assert timing.plain_read(path) == 1 << 20
    fraction = resident_fraction(path)
    assert fraction is None or fraction > 0.9  # just read, so in the page cache


def _script(name: str):
    """A script of benchmarks/ as a module (the scripts folder is no package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_server_infer_times_the_engine_against_a_local_continue(qwen3_dir, tmp_path, capsys):
    """benchmarks/server_infer.py runs the engine behind /v1/infer as it is today, on a tiny model."""
    script = _script("server_infer")
    argv = ["--model", str(qwen3_dir), "--tokens", "48", "--n", "3", "--reps", "2", "--threads", "1"]
    assert script.main([*argv, "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "48 tokens, question" in out and "server / local:" in out
    assert "same tokens from every request, local and server: yes" in out


def test_cached_ttft_runs_twice_and_compares_every_median(qwen3_dir, tmp_path, capsys):
    script = _script("cached_ttft")
    argv = [
        "--lengths",
        "32,16",
        "--schemes",
        "none,int8",
        "--reps",
        "1",
        "--prefill-reps",
        "1",
        "--runs",
        "2",
        "--threads",
        "1",
    ]
    argv += ["--model", str(qwen3_dir), "--workdir", str(tmp_path), "--json", str(tmp_path / "s.json")]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "## Run 1 of 2" in out and "## Run 2 of 2" in out and out.index("Run 1 of 2") < out.index("Run 2 of 2")
    stability = out[out.index("Stability:") :]
    runs = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert len(runs) == 2
    compared = [line for line in stability.splitlines() if line.startswith("| 16 ") or line.startswith("| 32 ")]
    expected = {
        (tokens, scheme, name)
        for tokens, row in runs[0].items()
        for scheme, cell in row.items()
        for name in cell
        if name != "bytes"
    }
    # One line per timed quantity of every length and scheme, the prefill and the streamed TTFT included.
    assert {tuple(cell.strip() for cell in line.split("|")[1:4]) for line in compared} == expected
    assert {("16", "none", "prefill"), ("32", "int8", "TTFT pipelined"), ("32", "none", "question")} <= expected
    for line in compared:
        tokens, scheme, name, *_, ratio, _flag = (cell.strip() for cell in line.split("|")[1:-1])
        first, second = (statistics.median(run[tokens][scheme][name]) for run in runs)
        assert float(ratio) == pytest.approx(max(first, second) / min(first, second), abs=0.006)
        assert ("**>10% apart**" in line) is (max(first, second) / min(first, second) > 1.1)
    assert not [p for p in tmp_path.glob("random-*")], "artifacts left behind"


def test_cached_ttft_flags_medians_more_than_ten_percent_apart(capsys):
    script = _script("cached_ttft")
    run1 = {512: {"none": {"bytes": 1, "load": [1.0, 1.0, 1.0], "read": [2.0]}}}
    run2 = {512: {"none": {"bytes": 1, "load": [1.0, 1.2, 1.3], "read": [2.1]}}}  # medians 1.0 vs 1.2; 2.0 vs 2.1
    assert script.print_stability([run1, run2]) == 1
    out = capsys.readouterr().out
    assert "| 512 | none | load | 1.000 | 1.200 | 1.20 | **>10% apart** |" in out
    assert "| 512 | none | read | 2.000 | 2.100 | 1.05 |  |" in out
    assert "1 of 2 medians within 10% across the runs" in out


@pytest.mark.slow
@pytest.mark.hosted
def test_server_fairness_runs_both_phases_against_a_real_server(tmp_path, capsys):
    """benchmarks/server_fairness.py starts kvcdn serve, floods it as tenant A and times tenant B."""
    script = _script("server_fairness")
    argv = ["--reps", "2", "--flood", "2", "--a-n", "8", "--b-n", "2", "--pause", "0", "--hidden", "64"]
    assert script.main([*argv, "--layers", "2", "--context", "1", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| idle |" in out and "| A floods |" in out and "B's median while A floods / idle:" in out
    assert "same tokens in every answer of B: yes" in out


def test_index_refresh_times_lookups_with_and_without_the_change_mark(capsys):
    """benchmarks/index_refresh.py on a small store: a local directory, one behind round trips, S3 (moto)."""
    script = _script("index_refresh")
    argv = ["--artifacts", "20", "--ops", "12", "--lookups", "5", "--adds", "4", "--removes", "3"]
    assert script.main([*argv, "--round-trip-ms", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| local") or "moto" in line]
    assert len(rows) == 3 and "| local directory, 1 ms a request |" in rows[1]
    for row in rows:
        assert "| 20 + 12 |" in row and "(0) |" in row and "(2) |" in row and row.count("|") == 10


def test_store_lookup_times_the_lookup_with_records_kept_and_parsed_each_time(capsys):
    """benchmarks/store_lookup.py on a small artifact: both ways find it."""
    script = _script("store_lookup")
    assert script.main(["--layers", "3", "--tokens", "300", "--lookups", "5"]) == 0
    out = capsys.readouterr().out
    assert (
        "3 layers, 300 tokens" in out and "| records kept |" in out and "| none kept: parsed at every lookup |" in out
    )
