"""benchmarks/peers.py's pure parts: the step order, the table's arithmetic and the verdict.

The benchmark itself needs llama-cpp-python (not a kvcdn dependency) and minutes of CPU; these
tests need neither.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_saves_come_first_then_rounds_across_the_ways(peers, tmp_path):
    """llama.cpp's state grows with the question: every save must come before the first cached run;
    the other steps then run in rounds, way after way, so a drifting machine slows all alike."""
    calls = []

    def way(tag, prefill_token):
        path = tmp_path / tag

        def step(name, token=None):
            def run():
                calls.append(f"{tag}.{name}")
                if name == "save":
                    path.write_bytes(b"x" * 1000)
                return token

            return run

        return peers.Way("f16", path, step("save"), step("load"), step("cached", 7), step("prefill", prefill_token))

    rows = peers.time_ways({"a": way("a", 7), "b": way("b", 8), "c": None}, reps=2)
    steps = ["load", "cached", "prefill"]
    warmups = [f"{w}.{s}" for w in "ab" for s in steps]
    rounds = [f"{w}.{s}" for w in "ab" for s in steps] * 2
    assert calls == ["a.save"] * 3 + ["b.save"] * 3 + warmups + rounds
    assert rows["a"]["bytes"] == 1000 and rows["a"]["kv"] == "f16" and rows["a"]["same_token"] is True
    assert rows["b"]["same_token"] is False and rows["c"] is None


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
