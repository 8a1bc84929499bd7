import pytest
from kvcdn_model_hybrid import HybridAdapter

from kvcdn_core import artifact as fmt
from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", HybridAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(HybridAdapter, architecture, tmp_path)
    manifest = fmt.read_manifest(tmp_path / f"{architecture}.kv")
    kinds = {layer["kind"] for layer in manifest["layers"]}
    assert kinds == {fmt.LINEAR_ATTENTION, fmt.FULL_ATTENTION}
    assert manifest["reuse"] == "whole_prefix"
