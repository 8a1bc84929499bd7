"""The MLA latent cache: what the artifact holds, that a prefix of it is exact, and the refusals."""

import dataclasses

import pytest
from kvcdn_model_deepseek import LATENT, ROTARY_KEY, DeepseekAdapter

from kvcdn_core import Manifest, artifact, runtime
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.exactness.architecture import long_context

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from kvcdn_core.model.tiny import build_tiny_model

    model_dir = build_tiny_model(DeepseekAdapter, "DeepseekV3ForCausalLM", tmp_path_factory.mktemp("v3"))
    return runtime.load_session(str(model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def header(session, tmp_path_factory):
    context = long_context(96, session.tokenizer)
    path, _ = runtime.generate(session, context, tmp_path_factory.mktemp("kv") / "doc.kv", progress=False)
    return artifact.read_header(path)


def test_artifact_holds_the_latent_not_per_head_keys(session, header):
    config = session.model.config
    manifest = header.manifest
    assert manifest["reuse"] == "any_prefix"
    per_token_floats = 0
    for layer in manifest["layers"]:
        assert layer["kind"] == artifact.MLA_LATENT
        assert set(layer["tensors"]) == {LATENT, ROTARY_KEY}
        latent = manifest["tensors"][layer["tensors"][LATENT]]["shape"]
        rotary = manifest["tensors"][layer["tensors"][ROTARY_KEY]]["shape"]
        assert latent == [1, 1, header.token_count, config.kv_lora_rank]
        assert rotary == [1, 1, header.token_count, config.qk_rope_head_dim]
        per_token_floats += config.kv_lora_rank + config.qk_rope_head_dim
    heads = config.num_attention_heads
    decompressed = (
        config.num_hidden_layers * heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    )
    assert per_token_floats * 4 == decompressed  # 40 vs 160 floats per token per layer here


def test_rebuilt_cache_is_the_prefill_cache(session, header):
    import torch

    ids = artifact.read_token_ids(header.path, header)
    fresh, _ = runtime.prefill(session, ids, progress=False)
    rebuilt, loaded_ids = runtime.load_cache(session, header)
    assert loaded_ids == ids
    for a, b in zip(fresh.layers, rebuilt.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("keep", [1, 57])
def test_a_cropped_latent_continues_exactly(session, header, keep):
    """mla_latent is croppable: any prefix of the stored latent continues like a fresh prefill."""
    ids = artifact.read_token_ids(header.path, header)
    question = session.adapter.encode_continuation(session.tokenizer, " What did the keeper write?")
    cache, _ = runtime.load_cache(session, header)
    cache.crop(keep - len(ids))  # transformers 5: a negative count of tokens to drop
    assert cache.get_seq_length() == keep
    cropped, _ = runtime.greedy(session, cache, ids[keep:] + question, 16)
    reference, _ = runtime.greedy(session, session.adapter.new_cache(session.model), ids + question, 16)
    assert cropped == reference
    assert len(set(reference)) > 3  # the check compares real output, not one repeated token


def test_other_widths_are_refused(session, header):
    layers = [layer.with_fields(kv_lora_rank=64) for layer in Manifest.from_dict(header.manifest).layers]
    tensors = artifact.load_tensors(header)
    with pytest.raises(ArtifactError, match="latent of 64"):
        session.adapter.import_cache(session.model, layers, tensors, "cpu")


def test_full_attention_artifact_is_refused(session, header):
    layers = [
        dataclasses.replace(layer, kind=artifact.FULL_ATTENTION) for layer in Manifest.from_dict(header.manifest).layers
    ]
    with pytest.raises(ArtifactError, match="'full_attention' in the artifact"):
        session.adapter.import_cache(session.model, layers, artifact.load_tensors(header), "cpu")


def test_a_cache_of_decompressed_heads_is_refused(session):
    """If transformers cached per-head keys and values, the adapter must not call them a latent."""
    import torch
    from transformers import DynamicCache

    config = session.model.config
    cache = DynamicCache(config=config)
    for index in range(config.num_hidden_layers):
        keys = torch.zeros(1, config.num_attention_heads, 5, config.qk_nope_head_dim + config.qk_rope_head_dim)
        values = torch.zeros(1, config.num_attention_heads, 5, config.v_head_dim)
        cache.update(keys, values, index)
    with pytest.raises(KvcdnError, match="caches MLA differently"):
        session.adapter.export_cache(session.model, cache)


def test_a_sliding_layer_is_refused(session):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    with pytest.raises(KvcdnError, match="DynamicSlidingWindowLayer"):
        session.adapter.export_layer(0, DynamicSlidingWindowLayer(sliding_window=8))
