"""The quality table of docs/quantization.md cannot rot: ``benchmarks/quant_smollm2.py`` run end to end
on two short contexts of SmolLM2-135M-Instruct (real trained weights), and its contexts cut again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import quant_report
    import quant_smollm2

    return quant_report, quant_smollm2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvcdn_core.testing.smollm2 import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


def test_contexts_are_reproducible_and_cut_where_they_say(bench, tokenizer):
    quant_report, _ = bench
    texts = quant_report.stdlib_sources()
    assert "LICENSE.txt" in dict(texts) and len(texts) > 100
    assert not any("site-packages" in name or name.startswith("test/") for name, _ in texts)
    cases = quant_report.text_slices(tokenizer, texts, [32, 96], 3, 8, seed=7)
    assert [c["tokens"] for c in cases] == [32, 32, 32, 96, 96, 96]
    assert cases == quant_report.text_slices(tokenizer, texts, [32, 96], 3, 8, seed=7)
    assert cases != quant_report.text_slices(tokenizer, texts, [32, 96], 3, 8, seed=8)
    assert len({c["source"] for c in cases[:3]}) == 3  # distinct texts while there are enough
    for case in cases:
        ids = tokenizer(dict(texts)[case["source"]], add_special_tokens=False)["input_ids"]
        start, length = case["start"], case["tokens"]
        assert case["context"] == ids[start : start + length]
        assert case["continuation"] == ids[start + length : start + length + 8]
    with pytest.raises(SystemExit, match="only 0 of 1 contexts"):
        quant_report.text_slices(tokenizer, [("short", "too short")], [32], 1, 8)


def test_smollm2_quality_on_two_short_contexts(bench, tmp_path, capsys):
    _, quant_smollm2 = bench
    out = tmp_path / "quality.json"
    args = ["--contexts", "1", "--lengths", "48,80", "--continuation", "12", "--greedy", "4", "--threads", "1"]
    assert quant_smollm2.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(c["tokens"], c["start"] >= 0) for c in report["cases"]] == [(48, True), (80, True)]
    assert report["steps"] == 24 and report["continuation"] == 12 and report["greedy"] == 4
    rows = {(r["scheme"], r["tokens"]): r for r in report["rows"]}
    schemes = ["int8", "fp8", "int4 r128", "int4 r0", "int2 r128", "int2 r0"]
    assert list(rows) == [(s, t) for t in (48, 80) for s in schemes]
    for tokens in (48, 80):
        # a residual window longer than the context keeps every token bitwise: nothing may differ
        for scheme in ("int4 r128", "int2 r128"):
            r = rows[scheme, tokens]
            assert (r["agreement_min"], r["kl_max"], r["max_abs_logit_diff"], r["greedy_identical"]) == (1, 0, 0, 1)
        kl = {s: rows[s, tokens]["kl_mean"] for s in ("int8", "int4 r0", "int2 r0")}
        assert 0 < kl["int8"] < kl["int4 r0"] < kl["int2 r0"], kl  # trained weights: orders of magnitude apart
        assert rows["int8", tokens]["agreement_mean"] >= 0.9
        for r in (rows[s, tokens] for s in schemes):
            assert r["agreement_min"] <= r["agreement_p5"] <= r["agreement_mean"] <= 1
            assert r["kl_mean"] <= r["kl_p95"] <= r["kl_max"]
    printed = capsys.readouterr().out
    assert "| int2 r0 | 80 |" in printed and "- 48 tokens: `" in printed
    assert f"`{report['cases'][1]['source']}@{report['cases'][1]['start']}`" in printed
