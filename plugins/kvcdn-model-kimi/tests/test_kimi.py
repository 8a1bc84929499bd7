"""Kimi Linear: KDA linear-attention state and MLA latent in one artifact, continued exactly.

Float32, on the tiny configs, against a full prefill of the same token ids.
"""

import dataclasses

import pytest
import torch
from kvcdn_model_kimi import KimiAdapter

from kvcdn_core import Manifest, artifact
from kvcdn_core.testing import assert_adapter_contract
from kvcdn_core.testing.continuation import (
    assert_reusable_only_whole,
    context_ids,
    lost_state_error,
    question_ids,
    restored_and_full,
    save_prefix,
)

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

KIMI = "KimiLinearForCausalLM"


@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session(KimiAdapter, KIMI)


def test_adapter_contract(tmp_path):
    """Every tiny shape: bitwise round trip, token-exact continuation against a full prefill."""
    assert_adapter_contract(KimiAdapter, KIMI, tmp_path)


def test_manifest_holds_the_delta_state_and_the_latent(session, tmp_path):
    config = session.model.config
    header = save_prefix(session, context_ids(session, 40), tmp_path / "ctx.kv")
    manifest = header.manifest
    assert [layer["kind"] for layer in manifest["layers"]] == [artifact.LINEAR_ATTENTION, artifact.MLA_LATENT] * 2
    assert manifest["reuse"] == "whole_prefix"
    linear, mla = manifest["layers"][0], manifest["layers"][1]
    assert set(linear["tensors"]) == {"conv_state", "recurrent_state"}
    assert linear["conv_kernel"] == config.linear_conv_kernel_dim
    state = manifest["tensors"][linear["tensors"]["recurrent_state"]]
    assert state["shape"] == [1, config.linear_num_heads, config.linear_head_dim, config.linear_head_dim]
    assert state["dtype"] == "F32"
    assert set(mla["tensors"]) == {"latent", "rotary_key"}
    assert (mla["kv_lora_rank"], mla["qk_rope_head_dim"]) == (config.kv_lora_rank, config.qk_rope_head_dim)
    latent = manifest["tensors"][mla["tensors"]["latent"]]["shape"]
    assert latent == [1, 1, header.token_count, config.kv_lora_rank]


def test_multi_token_question_on_restored_state(session, tmp_path):
    header = save_prefix(session, context_ids(session, 150), tmp_path / "ctx.kv")
    question = question_ids(session)
    restored, full = restored_and_full(session, header, question)
    # The chunked KDA kernel sums in blocks aligned to each call's start: float32 rounding only
    # (measured 8e-5 on logits of ~10); a lost delta-rule memory differs by ~11.
    torch.testing.assert_close(restored, full, rtol=1e-4, atol=1e-3)
    assert torch.equal(restored.argmax(-1), full.argmax(-1))
    # Control: a cache whose delta-rule memory was lost fails the same comparison clearly.
    assert lost_state_error(session, header, question, full, layers=[0]) > 1


def test_crop_is_refused_whole_prefix_reuses(session, tmp_path):
    assert_reusable_only_whole(session, save_prefix(session, context_ids(session, 40), tmp_path / "ctx.kv"))


def test_mla_layer_mismatch_is_refused(session, tmp_path):
    from kvcdn_core.errors import ArtifactError

    header = save_prefix(session, context_ids(session, 40), tmp_path / "ctx.kv")
    tensors = artifact.load_tensors(header)
    layers = Manifest.from_dict(header.manifest).layers
    wider = [layer.with_fields(kv_lora_rank=64) if layer.kind == artifact.MLA_LATENT else layer for layer in layers]
    with pytest.raises(ArtifactError, match="latent of 64"):
        session.adapter.import_cache(session.model, wider, tensors, "cpu")
    swapped = [
        dataclasses.replace(layer, kind=artifact.LINEAR_ATTENTION) if layer.kind == artifact.MLA_LATENT else layer
        for layer in layers
    ]
    with pytest.raises(ArtifactError, match="'linear_attention' in the artifact"):
        session.adapter.import_cache(session.model, swapped, tensors, "cpu")
