import pytest
from kvcdn_model_olmo_granite import OlmoGraniteAdapter

from kvcdn_core import artifact
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.mark.parametrize("architecture", sorted(OlmoGraniteAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(OlmoGraniteAdapter, architecture, tmp_path)
    manifest = artifact.read_manifest(tmp_path / f"{architecture}.kv")
    config = OlmoGraniteAdapter.validation_configs[architecture]
    window = config.get("sliding_window")
    types = config.get("layer_types") or ["sliding_attention" if window else "full_attention"] * 2
    want = [artifact.SLIDING_WINDOW if t == "sliding_attention" else artifact.FULL_ATTENTION for t in types]
    assert [layer["kind"] for layer in manifest["layers"]] == want
    if window:
        assert manifest["layers"][0]["window"] == window
        assert manifest["layers"][0]["cumulative_length"] == manifest["token_count"] > 2 * window
