"""The guarded generic adapter: an unclaimed architecture is served only after its guard passed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvcdn_model_generic import REFUSED, adapter_class, record_path, verdict
from kvcdn_model_generic.shrink import shrink

from kvcdn_core.model.tiny import SAMPLE_TEXT, build_tiny_model

PASSES = "PersimmonForCausalLM"  # plain full attention: no family claims it in this repository
#: xLSTM keeps its recurrent state in its own xLSTMCache, outside transformers' Cache API: given a
#: cache kvcdn can export, its forward fails, so the guard's round trip fails and nothing is served.
FAILS = "xLSTMForCausalLM"


def real_config(architecture: str) -> dict:
    import transformers

    return getattr(transformers, architecture).config_class().to_dict()


def model_dir(architecture: str, where):
    """A saved tiny model of ``architecture``, as a user's checkpoint would be (config.json + weights)."""
    cls = adapter_class(architecture, shrink(real_config(architecture)))
    return build_tiny_model(cls, architecture, where)


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    return tmp_path


def kvcdn(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "kvcdn_core", *map(str, args)], capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_no_family_claims_the_test_architectures(discovered_host):
    claimed = discovered_host.model_adapters()
    assert PASSES not in claimed and FAILS not in claimed


def test_unclaimed_architecture_is_served_after_its_guard_passes(xdg):
    model = model_dir(PASSES, xdg / "model")
    context = xdg / "context.txt"
    context.write_text(SAMPLE_TEXT, encoding="utf-8")
    code, _, err = kvcdn("generate", "--model", model, "--context-file", context, "-o", xdg / "doc.kv", "-q")
    assert code == 0, err
    assert "validating it on a tiny config" in err  # the guard ran, once
    record = json.loads(record_path(PASSES).read_text())
    assert record["passed"] and [p["phase"] for p in record["phases"]] == ["roundtrip", "reference", "cache"]

    code, out, err = kvcdn(
        "verify",
        "--model",
        model,
        "--kv-path",
        xdg / "doc.kv",
        "--question",
        "\nQ: Why?\nA:",
        "--n",
        16,
        "--format",
        "json",
        "-q",
    )
    assert code == 0, err
    assert json.loads(out)["matches"] == 16
    assert "validating" not in err  # the stored verdict is reused

    code, out, _ = kvcdn("inspect", xdg / "doc.kv", "--format", "json")
    assert json.loads(out)["manifest"]["model"]["family"] == "generic"
    code, out, _ = kvcdn("plugins")
    assert any(line.split()[0] == "generic" and line.split()[-1] == "loaded" for line in out.splitlines()[1:])


def test_architecture_whose_guard_fails_is_never_served(xdg):
    model = model_dir(FAILS, xdg / "model")
    context = xdg / "context.txt"
    context.write_text(SAMPLE_TEXT, encoding="utf-8")
    for _ in range(2):  # the second time from the stored verdict
        code, out, err = kvcdn("generate", "--model", model, "--context-file", context, "-o", xdg / "doc.kv", "-q")
        assert code == 2 and out == ""
        assert "guard failed" in err and "not served" in err and "Traceback" not in err
    assert not (xdg / "doc.kv").exists()
    assert json.loads(record_path(FAILS).read_text())["passed"] is False


def test_a_failed_verdict_is_a_refusal_even_for_a_good_architecture(xdg):
    """The stored verdict decides: a failed record is never overridden by serving anyway."""
    record = record_path(PASSES)
    record.parent.mkdir(parents=True)
    record.write_text(
        json.dumps({"passed": False, "phases": [{"phase": "cache", "passed": False, "detail": "token match 3/16"}]})
    )
    result = verdict(PASSES, real_config(PASSES))
    assert isinstance(result, str) and "cache: token match 3/16" in result


def test_known_inexact_architectures_are_refused_with_the_reason(xdg):
    for arch, reason in REFUSED.items():
        result = verdict(arch, {})
        assert isinstance(result, str) and reason in result
    assert not any(record_path(arch).exists() for arch in REFUSED)  # no guard was run


def test_shrink_keeps_the_architecture_switches():
    config = dict(
        real_config("Qwen3ForCausalLM"),
        sliding_window=4096,
        use_sliding_window=True,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=36,
        layer_types=["sliding_attention", "full_attention"] * 18,
    )
    tiny = shrink(config)
    assert tiny["hidden_size"] == 64 and tiny["num_attention_heads"] == 4 and tiny["num_key_value_heads"] == 2
    assert tiny["sliding_window"] == 16 and tiny["use_sliding_window"] is True
    assert tiny["num_hidden_layers"] == len(tiny["layer_types"]) == 4
    assert set(tiny["layer_types"]) == {"sliding_attention", "full_attention"}
    assert "vocab_size" not in tiny and "architectures" not in tiny
