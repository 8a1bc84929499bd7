import pytest
from kvcdn_model_glm import GlmAdapter

from kvcdn_core import artifact
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.mark.parametrize("architecture", sorted(GlmAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(GlmAdapter, architecture, tmp_path)
    manifest = artifact.read_manifest(tmp_path / f"{architecture}.kv")
    assert [layer["kind"] for layer in manifest["layers"]] == [artifact.FULL_ATTENTION] * 2
    assert manifest["model"]["family"] == "glm"
