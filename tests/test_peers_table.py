"""benchmarks/peers.py's pure parts: the step order, the table's arithmetic and the verdict.

The benchmark itself needs llama-cpp-python (not a kvcdn dependency) and minutes of CPU; these
tests need neither.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_save_runs_before_the_question_touches_the_state(peers, tmp_path):
    """llama.cpp's state grows with the question: every save must come before the first cached run."""
    path = tmp_path / "state"
    calls = []

    def step(name, token=None):
        def run():
            calls.append(name)
            if name == "save":
                path.write_bytes(b"x" * 1000)
            return token

        return run

    row = peers.timed_row("f16", step("save"), step("load"), step("cached", 7), step("prefill", 7), path, reps=2)
    assert calls == ["save"] * 3 + ["load"] * 3 + ["cached"] * 3 + ["prefill"] * 3
    assert row["bytes"] == 1000 and row["kv"] == "f16" and row["same_token"] is True
    row = peers.timed_row("f16", step("save"), step("load"), step("cached", 7), step("prefill", 8), path, reps=1)
    assert row["same_token"] is False


def result(ttft_s, prefill_s, bytes_=4_000_000, load_s=0.002, same=True):
    return dict(kv="f16", bytes=bytes_, save_s=0.01, load_s=load_s, prefill_s=prefill_s, ttft_s=ttft_s, same_token=same)


def test_table_row_arithmetic(peers):
    row = peers.table_row(1000, "llama.cpp", result(ttft_s=0.5, prefill_s=10.0, same=False))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["1000", "llama.cpp", "f16", "4,000", "0.010", "2.00", "10.000", "0.500", "20.0x", "NO"]
    assert peers.table_row(256, "llama.cpp", None).endswith("| not installed |")


def test_slowest_ignores_ways_not_run(peers):
    rows = {
        "kvcdn": result(ttft_s=0.3, prefill_s=9.0),  # 30x
        "transformers + safetensors": result(ttft_s=0.4, prefill_s=6.0),  # 15x
        "llama.cpp": None,
    }
    assert peers.slowest(rows) == ("transformers + safetensors", "transformers + safetensors")
    rows["llama.cpp"] = result(ttft_s=0.1, prefill_s=1.0)  # 10x: fastest TTFT, smallest speedup
    assert peers.slowest(rows) == ("transformers + safetensors", "llama.cpp")
