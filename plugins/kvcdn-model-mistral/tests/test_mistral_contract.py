import pytest
from kvcdn_model_mistral import MistralAdapter

from kvcdn_core import artifact
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

EXPECTED_KINDS = {
    "MistralForCausalLM": [artifact.SLIDING_WINDOW] * 2,
    "MixtralForCausalLM": [artifact.FULL_ATTENTION] * 2,
}


@pytest.mark.parametrize("architecture", sorted(MistralAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(MistralAdapter, architecture, tmp_path)
    manifest = artifact.read_manifest(tmp_path / f"{architecture}.kv")
    assert [layer["kind"] for layer in manifest["layers"]] == EXPECTED_KINDS[architecture]
    window = MistralAdapter.validation_configs[architecture].get("sliding_window")
    for layer in manifest["layers"]:
        if layer["kind"] == artifact.SLIDING_WINDOW:
            # the context crossed the window: the layer keeps window - 1 tokens, counts them all
            assert layer["window"] == window
            assert layer["cumulative_length"] == manifest["token_count"] > 2 * window
    # a sliding-window cache holds only the last window - 1 tokens: reusable only as a whole
    assert manifest["reuse"] == ("whole_prefix" if window else "any_prefix")


def test_mixtral_with_sliding_window_is_exact(tmp_path):
    class SlidingMixtral(MistralAdapter):
        validation_configs = {
            "MixtralForCausalLM": dict(MistralAdapter.validation_configs["MixtralForCausalLM"], sliding_window=16)
        }

    assert_adapter_contract(SlidingMixtral, "MixtralForCausalLM", tmp_path)
    kinds = [layer["kind"] for layer in artifact.read_manifest(tmp_path / "MixtralForCausalLM.kv")["layers"]]
    assert kinds == [artifact.SLIDING_WINDOW] * 2
