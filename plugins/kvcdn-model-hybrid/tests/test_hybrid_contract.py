import pytest
from kvcdn_model_hybrid import HybridAdapter

from kvcdn_core import artifact
from kvcdn_core.testing import assert_adapter_contract

#: The layer kinds each architecture's tiny default config writes.
KINDS = {
    "JambaForCausalLM": {artifact.LINEAR_ATTENTION, artifact.FULL_ATTENTION},
    "GraniteMoeHybridForCausalLM": {artifact.LINEAR_ATTENTION, artifact.FULL_ATTENTION},
    "Lfm2ForCausalLM": {artifact.LINEAR_ATTENTION, artifact.FULL_ATTENTION},
    "Lfm2MoeForCausalLM": {artifact.LINEAR_ATTENTION, artifact.FULL_ATTENTION},
    "BambaForCausalLM": {artifact.LINEAR_ATTENTION, artifact.FULL_ATTENTION},
    "FalconH1ForCausalLM": {artifact.LINEAR_AND_FULL_ATTENTION},
    "ZambaForCausalLM": {artifact.LINEAR_ATTENTION, artifact.LINEAR_AND_FULL_ATTENTION},
    "Zamba2ForCausalLM": {artifact.LINEAR_ATTENTION, artifact.LINEAR_AND_FULL_ATTENTION},
}


def test_every_architecture_has_its_kinds():
    assert set(KINDS) == set(HybridAdapter.architectures)


@pytest.mark.parametrize("architecture", HybridAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(HybridAdapter, architecture, tmp_path)
    manifest = artifact.read_manifest(tmp_path / f"{architecture}.kv")
    kinds = {layer["kind"] for layer in manifest["layers"]}
    assert kinds == KINDS[architecture]
    assert manifest["reuse"] == "whole_prefix"
