"""GLM-MoE-DSA: DeepSeek sparse attention with layers that reuse an earlier layer's selection."""

import pytest
from kvcdn_model_glm import GlmDsaAdapter

from kvcdn_core import artifact, runtime
from kvcdn_core.model.tiny import build_tiny_model, config_variants
from kvcdn_core.testing import assert_adapter_contract, assert_prefix_reuse

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

ARCH = "GlmMoeDsaForCausalLM"


def test_adapter_contract(tmp_path):
    """Every shape; a layer with its own indexer stores its keys, a "shared" one only the latent."""
    assert_adapter_contract(GlmDsaAdapter, ARCH, tmp_path)
    for variant, config in config_variants(GlmDsaAdapter, ARCH).items():
        where = tmp_path if variant == "default" else tmp_path / variant
        manifest = artifact.read_manifest(where / f"{ARCH}.kv")
        assert manifest["model"]["family"] == "glm" and manifest["reuse"] == "any_prefix"
        assert config["index_topk"] < manifest["token_count"] // 4
        expected = [artifact.MLA_INDEXED if t == "full" else artifact.MLA_LATENT for t in config["indexer_types"]]
        assert [layer["kind"] for layer in manifest["layers"]] == expected
        for layer in manifest["layers"]:
            assert ("indexer_key" in layer["tensors"]) == (layer["kind"] == artifact.MLA_INDEXED)


def test_prefix_search_crops_exactly(tmp_path):
    model = build_tiny_model(GlmDsaAdapter, ARCH, tmp_path / "model")
    session = runtime.load_session(str(model), device="cpu", dtype="float32")
    (tmp_path / "arts").mkdir()
    assert assert_prefix_reuse(session, tmp_path / "arts") > session.model.config.index_topk
