"""``kvcdn validate``: the table, JSON and markdown output, exit codes, and that it catches a broken
adapter. Uses an adapter registered in-process, so it runs without any family plugin installed."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvcdn_core import ModelAdapter, hookimpl

SLIDING_QWEN2 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    use_sliding_window=True,
    sliding_window=16,
    max_window_layers=0,
    layer_types=["sliding_attention", "sliding_attention"],
)


class WindowAdapter(ModelAdapter):
    family = "testwindow"
    architectures = ("Qwen2ForCausalLM",)
    validation_configs = {"Qwen2ForCausalLM": SLIDING_QWEN2}


class ForgetfulAdapter(WindowAdapter):
    """A plausible bug: the sliding-window layer's cumulative length is not restored on import."""

    family = "testforgetful"

    def import_layer(self, entry, named, layer):
        super().import_layer(entry, named, layer)
        layer.cumulative_length = int(named["key"].shape[-2])


class _Plugin:
    def __init__(self, cls):
        self.cls = cls

    @hookimpl
    def kvcdn_register_model_adapters(self):
        return [self.cls]


def invoke(args):
    from kvcdn_core.cli.app import make_cli

    return CliRunner().invoke(make_cli(), ["validate", *args])


@pytest.fixture
def window_host(kvcdn_host):
    kvcdn_host.register(_Plugin(WindowAdapter), "testwindow", "kvcdn.models")
    return kvcdn_host


def test_passing_family_as_json(window_host):
    result = invoke(["--family", "testwindow", "--format", "json", "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"] is True
    (arch,) = data["architectures"]
    assert (arch["family"], arch["architecture"], arch["requirement"]) == (
        "testwindow",
        "Qwen2ForCausalLM",
        "kvcdn[testwindow]",
    )
    # the core phases first; quantizers may append their own
    assert [p["phase"] for p in arch["phases"]][:3] == ["roundtrip", "reference", "cache"]
    assert all(p["passed"] and p["seconds"] > 0 for p in arch["phases"])
    assert arch["layers"] == "2 sliding_window(16)"
    assert "token match 16/16" in arch["phases"][2]["detail"]


def test_broken_adapter_fails_with_first_divergence(kvcdn_host):
    kvcdn_host.register(_Plugin(ForgetfulAdapter), "testforgetful", "kvcdn.models")
    narrow = invoke(["-q"])
    assert narrow.exit_code == 1, narrow.output
    head, first = narrow.stdout.splitlines()[:2]
    assert head.split() == ["FAMILY", "ARCHITECTURE", "CHECKS", "TOTAL"]
    cells = first.split()
    assert cells[:3] == ["testforgetful", "Qwen2ForCausalLM", "FAIL"]
    assert cells[3].startswith("cache@")  # the first failed phase, at its first divergent token
    assert max(len(head), len(first)) <= 100
    result = invoke(["-q", "--wide"])
    assert result.exit_code == 1, result.output
    header, row = result.stdout.splitlines()[:2]
    assert header.split()[:5] == ["FAMILY", "ARCHITECTURE", "ROUNDTRIP", "REFERENCE", "CACHE"]
    cells = row.split()  # family, architecture, then "STATUS SECONDS" per phase
    assert cells[:3] == ["testforgetful", "Qwen2ForCausalLM", "PASS"]
    assert cells[4] == "PASS" and cells[6].startswith("FAIL@")  # cache: with the first divergent token
    assert "Qwen2ForCausalLM cache: token match" in result.stdout
    assert "0/1 architectures pass" in result.stdout
    assert "error: validation failed for 1 of 1 architectures: Qwen2ForCausalLM" in result.stderr


def test_unknown_family_lists_installed_ones(window_host):
    result = invoke(["--family", "nope"])
    assert result.exit_code == 2
    assert "error: unknown family 'nope'; installed families: testwindow" in result.stderr


def test_family_and_model_together_is_a_usage_error(window_host):
    result = invoke(["--family", "testwindow", "--model", "x"])
    assert result.exit_code == 2 and "not both" in result.stderr


def test_one_model_by_path(window_host, tiny_model):
    model_dir = tiny_model(WindowAdapter, "Qwen2ForCausalLM")
    result = invoke(["--model", str(model_dir), "--device", "cpu", "--n", "8", "--format", "json", "-q"])
    assert result.exit_code == 0, result.output
    (arch,) = json.loads(result.stdout)["architectures"]
    assert arch["source"] == str(model_dir) and arch["passed"]
    assert "token match 8/8" in arch["phases"][2]["detail"]


def test_markdown_is_the_support_table(window_host):
    result = invoke(["--format", "markdown", "-q", "--n", "4"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("| Architecture | Family | Install |")
    assert lines[2] == (
        "| `Qwen2ForCausalLM` | testwindow | `pip install 'kvcdn[testwindow]'` | "
        "2 sliding_window(16) | sliding_window | 4q/2kv×16 | PASS |"
    )


def test_the_summary_counts_architectures_by_name_and_shapes_apart():
    """'108/108 architectures pass' counted 108 shapes of 65 architectures."""
    import types

    from kvcdn_core.cli.commands.validate import ArchReport, pass_line

    ok, bad = types.SimpleNamespace(passed=True), types.SimpleNamespace(passed=False)

    def report(arch, variant, phase):
        return ArchReport("f", "kvcdn[f]", arch, "tiny", phases=[phase], variant=variant)

    reports = [report("A", "default", ok), report("A", "mha", ok), report("B", "default", ok), report("B", "x", bad)]
    assert pass_line(reports) == "1/2 architectures pass (3/4 shapes)"
    assert pass_line(reports[:3]) == "2/2 architectures pass (3/3 shapes)"
    assert pass_line([]) == "0/0 architectures pass (none installed)"
