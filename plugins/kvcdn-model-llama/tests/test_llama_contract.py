import pytest
from kvcdn_model_llama import LLAMA3_ROPE, LlamaAdapter

from kvcdn_core import artifact
from kvcdn_core.exactness.architecture import validate_tiny
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.mark.parametrize("architecture", sorted(LlamaAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(LlamaAdapter, architecture, tmp_path)
    kinds = {layer["kind"] for layer in artifact.read_manifest(tmp_path / f"{architecture}.kv")["layers"]}
    assert kinds == {artifact.FULL_ATTENTION}


def _variant(**overrides):
    class Variant(LlamaAdapter):
        validation_configs = {
            "LlamaForCausalLM": dict(LlamaAdapter.validation_configs["LlamaForCausalLM"], **overrides)
        }

    return Variant


def test_llama3_rope_scaling_is_exact(tmp_path):
    """Llama 3.1-style scaling (original context 64, shorter than the validation context)."""
    assert_adapter_contract(_variant(rope_parameters=dict(LLAMA3_ROPE)), "LlamaForCausalLM", tmp_path)


def test_dynamic_rope_within_its_length_is_exact(tmp_path):
    assert_adapter_contract(
        _variant(rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=512),
        "LlamaForCausalLM",
        tmp_path,
    )


def test_dynamic_rope_past_its_length_is_refused(tmp_path):
    """Dynamic NTK re-rotates every key once the sequence passes max_position_embeddings: refuse."""
    adapter = _variant(rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)
    results = validate_tiny(adapter, "LlamaForCausalLM", tmp_path)
    assert not results[0].passed
    assert "dynamic (NTK) RoPE" in results[0].detail and "64 tokens" in results[0].detail
    assert not (tmp_path / "LlamaForCausalLM.kv").exists()
