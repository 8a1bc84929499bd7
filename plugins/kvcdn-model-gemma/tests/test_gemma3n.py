"""Gemma 3n: only the layers that own a cache are stored; the layers that reuse them get them back."""

import pytest
from kvcdn_model_gemma import Gemma3nAdapter
from kvcdn_model_gemma.gemma3n import sharing

from kvcdn_core import LayerEntry, artifact, runtime
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.exactness.architecture import long_context
from kvcdn_core.model.tiny import build_tiny_model, config_variants
from kvcdn_core.testing import assert_adapter_contract, assert_prefix_reuse

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

ARCH = "Gemma3nForCausalLM"
KINDS = {"sliding_attention": artifact.SLIDING_WINDOW, "full_attention": artifact.FULL_ATTENTION}


def session_of(tmp_path, variant="default"):
    model = build_tiny_model(Gemma3nAdapter, ARCH, tmp_path / variant, variant=variant)
    return runtime.load_session(str(model), device="cpu", dtype="float32")


def test_adapter_contract(tmp_path):
    """Every shape; the manifest lists the cache-owning layers and who reuses them."""
    assert_adapter_contract(Gemma3nAdapter, ARCH, tmp_path)
    for variant, config in config_variants(Gemma3nAdapter, ARCH).items():
        where = tmp_path if variant == "default" else tmp_path / variant
        manifest = artifact.read_manifest(where / f"{ARCH}.kv")
        first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
        assert [layer["index"] for layer in manifest["layers"]] == list(range(first_shared))
        assert [layer["kind"] for layer in manifest["layers"]] == [
            KINDS[t] for t in config["layer_types"][:first_shared]
        ]
        readers = sorted(i for layer in manifest["layers"] for i in layer.get("shared_by", []))
        assert readers == list(range(first_shared, config["num_hidden_layers"]))
        for layer in manifest["layers"]:  # a reader has its owner's layer type
            for i in layer.get("shared_by", []):
                assert KINDS[config["layer_types"][i]] == layer["kind"]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return session_of(tmp_path_factory.mktemp("gemma3n"))


@pytest.fixture(scope="module")
def header(session, tmp_path_factory):
    path, _ = runtime.generate(
        session, long_context(96, session.tokenizer), tmp_path_factory.mktemp("kv") / "doc.kv", progress=False
    )
    return artifact.read_header(path)


def test_sharing_of_the_default_shape(session):
    assert sharing(session.model.config) == ([0, 1, 2], {1: [3, 4], 2: [5]})


def test_rebuilt_cache_is_the_prefill_cache(session, header):
    import torch
    from transformers.cache_utils import DummyLayer

    ids = artifact.read_token_ids(header.path, header)
    fresh, _ = runtime.prefill(session, ids, progress=False)
    rebuilt, _ = runtime.load_cache(session, header)
    assert [type(layer) for layer in rebuilt.layers] == [type(layer) for layer in fresh.layers]
    assert sum(isinstance(layer, DummyLayer) for layer in rebuilt.layers) == 3
    for a, b in zip(fresh.layers, rebuilt.layers):
        if not isinstance(a, DummyLayer):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_another_sharing_is_refused(session, header):
    tensors = artifact.load_tensors(header)
    entries = [LayerEntry.from_dict(layer) for layer in header.manifest["layers"]]
    moved = [entry.with_fields(shared_by=[5]) if entry.index == 1 else entry for entry in entries]
    with pytest.raises(ArtifactError, match=r"layer 1 is shared by layers \[5\] in the artifact, by \[3, 4\]"):
        session.adapter.import_cache(session.model, moved, tensors, "cpu")
    with pytest.raises(ArtifactError, match=r"stores the caches of layers \[0, 1\], this model's .* \[0, 1, 2\]"):
        session.adapter.import_cache(session.model, entries[:2], tensors, "cpu")


def test_a_windowed_artifact_is_not_cropped(session, header, tmp_path):
    """Sliding layers keep only their window: search prefills from scratch, crop refuses by name."""
    assert header.manifest["reuse"] == "whole_prefix"
    assert assert_prefix_reuse(session, tmp_path) == 0
    cache, ids = runtime.load_cache(session, header)
    with pytest.raises(KvcdnError, match="layer 0 is 'sliding_window', reusable only as the whole prefix"):
        entries = [LayerEntry.from_dict(layer) for layer in header.manifest["layers"]]
        session.adapter.crop(cache, entries, 40, token_count=len(ids))


def test_an_all_global_artifact_is_cropped_exactly(tmp_path):
    session = session_of(tmp_path, "global-shared2")
    (tmp_path / "arts").mkdir()
    assert assert_prefix_reuse(session, tmp_path / "arts") > 40
