import pytest
from kvcdn_model_gemma import GemmaAdapter

from kvcdn_core import artifact
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

F, S = artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW
EXPECTED_KINDS = {
    "GemmaForCausalLM": [F, F],
    "Gemma2ForCausalLM": [S, F],
    "Gemma3ForCausalLM": [S, F, S, F],
}


@pytest.mark.parametrize("architecture", sorted(GemmaAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    """Sliding layers alternate with global ones; the context crosses the 16-token window."""
    assert_adapter_contract(GemmaAdapter, architecture, tmp_path)
    manifest = artifact.read_manifest(tmp_path / f"{architecture}.kv")
    assert [layer["kind"] for layer in manifest["layers"]] == EXPECTED_KINDS[architecture]
    for layer in manifest["layers"]:
        if layer["kind"] == S:
            assert layer["window"] == 16
            assert layer["cumulative_length"] == manifest["token_count"] > 2 * 16


def test_gemma3_with_sliding_window_pattern_is_exact(tmp_path):
    """Gemma 3 checkpoints give sliding_window_pattern rather than layer_types (5 local : 1 global)."""
    config = {k: v for k, v in GemmaAdapter.validation_configs["Gemma3ForCausalLM"].items() if k != "layer_types"}

    class PatternGemma3(GemmaAdapter):
        validation_configs = {"Gemma3ForCausalLM": dict(config, num_hidden_layers=3, sliding_window_pattern=3)}

    assert_adapter_contract(PatternGemma3, "Gemma3ForCausalLM", tmp_path)
    kinds = [layer["kind"] for layer in artifact.read_manifest(tmp_path / "Gemma3ForCausalLM.kv")["layers"]]
    assert kinds == [S, S, F]
