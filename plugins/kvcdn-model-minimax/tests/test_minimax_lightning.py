"""MiniMax-Text-01: lightning-attention states and softmax keys/values, continued exactly.

Float32, on the tiny configs, against a full prefill of the same token ids.
"""

import pytest
import torch
from kvcdn_model_minimax.lightning import LightningAdapter

from kvcdn_core import artifact
from kvcdn_core.testing import assert_adapter_contract
from kvcdn_core.testing.continuation import (
    assert_chunked_prefill_is_one_pass,
    assert_reusable_only_whole,
    context_ids,
    lost_state_error,
    question_ids,
    restored_and_full,
    save_prefix,
)

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

ARCH = "MiniMaxForCausalLM"


@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session(LightningAdapter, ARCH)


def test_adapter_contract(tmp_path):
    """Every tiny shape: bitwise round trip, token-exact continuation against a full prefill."""
    assert_adapter_contract(LightningAdapter, ARCH, tmp_path)


def test_manifest_holds_one_state_per_lightning_layer(session, tmp_path):
    config = session.model.config
    header = save_prefix(session, context_ids(session, 40), tmp_path / "ctx.kv")
    manifest = header.manifest
    assert [layer["kind"] for layer in manifest["layers"]] == [artifact.LINEAR_ATTENTION, artifact.FULL_ATTENTION] * 2
    assert manifest["reuse"] == "whole_prefix"
    lightning, softmax = manifest["layers"][0], manifest["layers"][1]
    assert set(lightning["tensors"]) == {"recurrent_state"}
    shape = manifest["tensors"][lightning["tensors"]["recurrent_state"]]["shape"]
    assert shape == [1, config.num_attention_heads, config.head_dim, config.head_dim]
    assert manifest["tensors"][softmax["tensors"]["key"]]["shape"][2] == header.token_count


def test_transformers_own_cache_loses_the_length(session):
    """The reason for LightningCache: with a lightning first layer, MiniMaxCache reports 0 tokens
    after a prefill, and a question continued on it differs from the full prefill (measured: by 15
    on logits of ~9)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    model, adapter = session.model, session.adapter
    ids, question = context_ids(session, 150), question_ids(session)
    assert model.config.layer_types[0] == "linear_attention"
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([ids + question]), cache=MiniMaxCache(), use_cache=True).logits
        stock, ours = MiniMaxCache(), adapter.new_cache(model)
        model(input_ids=torch.tensor([ids]), cache=stock, use_cache=True)
        adapter.forward(model, torch.tensor([ids]), ours)
        assert stock.get_seq_length() == 0 and ours.get_seq_length() == len(ids)
        on_stock = model(input_ids=torch.tensor([question]), cache=stock, use_cache=True).logits
        on_ours, _ = adapter.forward(model, torch.tensor([question]), ours)
    full = full[:, len(ids) :]
    assert float((on_stock - full).abs().max()) > 1
    torch.testing.assert_close(on_ours, full, rtol=1e-4, atol=1e-3)


def test_chunked_prefill_gives_the_one_pass_state(session):
    # One pass sums each 16-token block at once, a continued state token by token: the same sums in
    # another order. Measured: 1e-3 on lightning states of ~300-450, 4.5e-4 on logits of ~6.
    assert_chunked_prefill_is_one_pass(session, atol=1e-3)


def test_multi_token_question_on_restored_state(session, tmp_path):
    header = save_prefix(session, context_ids(session, 150), tmp_path / "ctx.kv")
    question = question_ids(session)
    restored, full = restored_and_full(session, header, question)
    # Measured 6.5e-4 on logits of ~9 (block sums against the recurrence); lost states differ by ~15.
    torch.testing.assert_close(restored, full, rtol=1e-4, atol=1e-3)
    assert torch.equal(restored.argmax(-1), full.argmax(-1))
    # Control: a cache whose lightning states were lost fails the same comparison clearly.
    assert lost_state_error(session, header, question, full, layers=[0, 2]) > 1


def test_crop_is_refused_whole_prefix_reuses(session, tmp_path):
    assert_reusable_only_whole(session, save_prefix(session, context_ids(session, 40), tmp_path / "ctx.kv"))
