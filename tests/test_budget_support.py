"""The test suite's time limits scale with the machine's measured speed (tests/support/budget.py),
and a long docs example is stopped by its own block's budget, not by a fixed limit."""

from __future__ import annotations

import subprocess
import time

from tests.support import budget as budgets


def test_a_slower_workload_gives_a_proportionally_larger_budget(monkeypatch):
    monkeypatch.setattr(budgets, "_measured", None)
    monkeypatch.setattr(budgets, "_reference_workload", lambda: budgets.REFERENCE_S * 4)
    monkeypatch.delenv("KVCDN_TEST_TIME_SCALE", raising=False)
    assert budgets.budget(10) == 40.0
    monkeypatch.setattr(budgets, "_reference_workload", lambda: budgets.REFERENCE_S / 3)  # a fast machine
    monkeypatch.setattr(budgets, "_measured", None)
    assert budgets.budget(10) == 10.0  # never less than the idle figure
    monkeypatch.setenv("KVCDN_TEST_TIME_SCALE", "2.5")
    assert budgets.budget(10) == 25.0


def test_the_slowdown_is_measured_again_when_stale(monkeypatch):
    speeds = iter([2.0, 5.0])
    monkeypatch.setattr(budgets, "_measured", None)
    monkeypatch.setattr(budgets, "measure_slowdown", lambda: next(speeds))
    monkeypatch.delenv("KVCDN_TEST_TIME_SCALE", raising=False)
    assert budgets.slowdown() == 2.0 and budgets.slowdown() == 2.0  # cached
    when, factor = budgets._measured
    monkeypatch.setattr(budgets, "_measured", (when - budgets.RECALIBRATE_S - 1, factor))
    assert budgets.slowdown() == 5.0


def test_the_real_measurement_is_at_least_one():
    assert budgets.measure_slowdown(runs=1) >= 1.0


def test_a_docs_block_over_its_budget_is_stopped(monkeypatch):
    from tests import test_docs_examples as docs

    monkeypatch.setattr(docs, "budget", lambda seconds: 0.5)
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    watch = docs.BlockWatch(process)
    try:
        started = time.monotonic()
        process.wait(timeout=30)
        assert time.monotonic() - started < 30
        assert watch.expired and process.returncode == -9
    finally:
        watch.stop()
        if process.poll() is None:
            process.kill()
