"""Variants of the GPT-family configs that real checkpoints use, and the refusals."""

import pytest
from kvcdn_model_gpt import GptAdapter, caches_every_query_head

from kvcdn_core import Manifest, artifact, runtime
from kvcdn_core.errors import KvcdnError
from kvcdn_core.model.tiny import build_tiny_model
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


def variant(architecture: str, **changes):
    """An adapter whose tiny config for ``architecture`` has ``changes`` applied."""

    class Variant(GptAdapter):
        validation_configs = {architecture: dict(GptAdapter.validation_configs[architecture], **changes)}

    return Variant


@pytest.mark.parametrize(
    "changes",
    [
        # Falcon-7B: multi-query attention, parallel attention/MLP.
        dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, num_kv_heads=None),
        # Falcon-RW: ALiBi instead of rotary, one key/value head per query head.
        dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, alibi=True, num_kv_heads=None),
    ],
    ids=["falcon-7b-multi-query", "falcon-rw-alibi"],
)
def test_falcon_variants_are_exact(changes, tmp_path):
    assert_adapter_contract(variant("FalconForCausalLM", **changes), "FalconForCausalLM", tmp_path)


def test_gpt_bigcode_multi_head_is_exact(tmp_path):
    assert_adapter_contract(variant("GPTBigCodeForCausalLM", multi_query=False), "GPTBigCodeForCausalLM", tmp_path)


def _artifact(adapter_cls, architecture, tmp_path):
    model_dir = build_tiny_model(adapter_cls, architecture, tmp_path / "model")
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    path, _ = runtime.generate(session, "The lighthouse keeper kept a ledger.", tmp_path / "a.kv", progress=False)
    return session, artifact.read_header(path)


def test_falcon_grouped_heads_are_stored_once(tmp_path):
    """Falcon-40B layout: the artifact keeps num_kv_heads heads and the rebuilt cache is transformers' own
    (every query head's copy up to transformers 5.24, one head per group from 5.25)."""
    import torch

    session, header = _artifact(GptAdapter, "FalconForCausalLM", tmp_path)
    config = session.model.config
    layer = header.manifest["layers"][0]
    assert layer["kv_heads"] == config.num_kv_heads == 2
    assert layer["repeated_heads"] == config.num_attention_heads // config.num_kv_heads
    assert header.manifest["tensors"][layer["tensors"]["key"]]["shape"][1] == 2
    ids = artifact.read_token_ids(header.path, header)
    fresh, _ = runtime.prefill(session, ids, progress=False)
    rebuilt, _ = runtime.load_cache(session, header)
    cached_heads = config.num_attention_heads if caches_every_query_head() else config.num_kv_heads
    for a, b in zip(fresh.layers, rebuilt.layers):
        assert a.keys.shape[1] == cached_heads
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_manifest_names_position_encoding_and_kv_heads(tmp_path):
    _, header = _artifact(GptAdapter, "GPTBigCodeForCausalLM", tmp_path)
    for layer in header.manifest["layers"]:
        assert layer["kind"] == artifact.FULL_ATTENTION
        assert layer["kv_heads"] == 1
        assert layer["position_encoding"] == "learned"


def test_context_beyond_learned_positions_is_refused(tmp_path):
    small = variant("GPT2LMHeadModel", n_positions=32)
    model_dir = build_tiny_model(small, "GPT2LMHeadModel", tmp_path / "model")
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    with pytest.raises(KvcdnError, match="exceed the 32 learned positions"):
        runtime.generate(session, "The lighthouse keeper " * 20, tmp_path / "a.kv", progress=False)
    assert not list(tmp_path.glob("*.kv*"))


def test_cross_attention_config_is_refused(tmp_path):
    cross = variant("GPT2LMHeadModel", add_cross_attention=True)
    model_dir = build_tiny_model(cross, "GPT2LMHeadModel", tmp_path / "model")
    with pytest.raises(KvcdnError, match="encoder-decoder cache"):
        runtime.load_session(str(model_dir), device="cpu", dtype="float32")


@pytest.mark.parametrize("architecture", ["FalconForCausalLM", "BloomForCausalLM"])
def test_a_cropped_cache_continues_exactly(architecture, tmp_path):
    """Prefix search crops restored caches: exact for repeated (Falcon) heads and ALiBi (Bloom) too."""
    session, header = _artifact(GptAdapter, architecture, tmp_path)
    ids = artifact.read_token_ids(header.path, header)
    keep = len(ids) // 2
    tail = ids[keep:] + session.adapter.encode_continuation(session.tokenizer, " and the sea")
    cache, _ = runtime.load_cache(session, header)
    cache = session.adapter.crop(cache, Manifest.from_dict(header.manifest).layers, keep, token_count=len(ids))
    assert cache.get_seq_length() == keep
    cropped, _ = runtime.greedy(session, cache, tail, 16)
    reference, _ = runtime.greedy(session, session.adapter.new_cache(session.model), ids[:keep] + tail, 16)
    assert cropped == reference


def test_gpt_neo_local_layers_are_named(tmp_path):
    """GPT-Neo's local layers cache every token (full attention) and say what window they attend to."""
    _, header = _artifact(GptAdapter, "GPTNeoForCausalLM", tmp_path)
    global_layer, local_layer = header.manifest["layers"]
    assert global_layer["kind"] == local_layer["kind"] == artifact.FULL_ATTENTION
    assert "attention_window" not in global_layer
    assert local_layer["attention_window"] == 32
    assert header.manifest["tensors"][local_layer["tensors"]["key"]]["shape"][2] == header.token_count
