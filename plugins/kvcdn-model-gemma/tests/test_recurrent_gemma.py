"""RecurrentGemma: RG-LRU states kept in the cache, saved and continued exactly.

Float32, on the tiny configs, against a full prefill of the same token ids. The controls run
transformers' own behaviour on the same weights, to show what the adapter changes.
"""

import pytest
import torch
from kvcdn_model_gemma.recurrent import RecurrentGemmaAdapter

from kvcdn_core import artifact, runtime
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

ARCH = "RecurrentGemmaForCausalLM"


@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session(RecurrentGemmaAdapter, ARCH)


@pytest.fixture(scope="module")
def stock_model(tiny_model):
    """The same tiny weights loaded by transformers alone: no kvcdn wrapping."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model(RecurrentGemmaAdapter, ARCH), dtype=torch.float32).eval()


def test_adapter_contract(tmp_path):
    """Every tiny shape: bitwise round trip, token-exact continuation against a full prefill."""
    assert_adapter_contract(RecurrentGemmaAdapter, ARCH, tmp_path)


def test_manifest_holds_the_recurrent_states(session, tmp_path):
    config = session.model.config
    header = save_prefix(session, context_ids(session, 60), tmp_path / "ctx.kv")
    manifest = header.manifest
    kinds = [layer["kind"] for layer in manifest["layers"]]
    assert kinds == [artifact.LINEAR_ATTENTION, artifact.LINEAR_ATTENTION, artifact.SLIDING_WINDOW]
    recurrent, local = manifest["layers"][0], manifest["layers"][2]
    conv = manifest["tensors"][recurrent["tensors"]["conv_state"]]
    state = manifest["tensors"][recurrent["tensors"]["recurrent_state"]]
    assert conv["shape"] == [1, config.lru_width, config.conv1d_width - 1] and conv["dtype"] == "F32"
    assert state["shape"] == [1, config.lru_width] and state["dtype"] == "F32"
    assert recurrent["conv_kernel"] == config.conv1d_width - 1  # the inputs it keeps
    assert local["window"] == config.attention_window_size
    assert local["cumulative_length"] == header.token_count


def test_transformers_keeps_the_state_outside_the_cache(stock_model, session):
    """The refusal's cause: after a prefill through the cache API, the cache's slots are empty."""
    ids = torch.tensor([context_ids(session, 40)])
    cache = RecurrentGemmaAdapter().new_cache(stock_model)
    with torch.inference_mode():
        stock_model(input_ids=ids, cache=cache, use_cache=True)
    assert not cache.layers[0].has_previous_state[0]
    assert stock_model.model.layers[0].temporal_block.rg_lru.recurrent_states is not None


def test_transformers_chunked_prefill_restarts_the_convolution(stock_model, session):
    """Control: transformers' own second chunk restarts the convolution from zeros; ours continues it.

    The RG-LRU state carries over in both, so the error sits at the chunk boundary: measured 0.045
    on logits of ~1.6 for transformers, 4.8e-7 for the adapter (float32 rounding).
    """
    ids = torch.tensor([context_ids(session, 150)])
    adapter = session.adapter
    with torch.inference_mode():
        one = stock_model(input_ids=ids, cache=adapter.new_cache(stock_model), use_cache=True).logits[:, 64:]
        stock = adapter.new_cache(stock_model)
        stock_model(input_ids=ids[:, :64], cache=stock, use_cache=True)
        stock_rest = stock_model(input_ids=ids[:, 64:], cache=stock, use_cache=True).logits
        ours = adapter.new_cache(session.model)
        adapter.forward(session.model, ids[:, :64], ours)
        our_rest, _ = adapter.forward(session.model, ids[:, 64:], ours)
    stock_error, our_error = float((stock_rest - one).abs().max()), float((our_rest - one).abs().max())
    assert stock_error > 0.01 and our_error < 1e-4, (stock_error, our_error)


def test_chunked_prefill_gives_the_one_pass_state(session):
    assert_chunked_prefill_is_one_pass(session)


def test_multi_token_question_on_restored_state(session, tmp_path):
    header = save_prefix(session, context_ids(session, 150), tmp_path / "ctx.kv")
    question = question_ids(session)
    restored, full = restored_and_full(session, header, question)
    # Measured 3.6e-7 on logits of ~1.6 (soft-capped); a lost RG-LRU state differs by 0.11.
    torch.testing.assert_close(restored, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(restored.argmax(-1), full.argmax(-1))
    # Control: a cache whose RG-LRU states were lost fails the same comparison clearly.
    assert lost_state_error(session, header, question, full, layers=[0, 1]) > 0.05


def test_two_caches_on_one_model_stay_apart(session, tmp_path):
    """The state is the cache's, not the model's: another sequence run in between changes nothing."""
    header = save_prefix(session, context_ids(session, 80), tmp_path / "ctx.kv")
    restored, _ = runtime.load_cache(session, header)
    other = question_ids(session, " An unrelated document about harbour records and storms at sea.")
    runtime.prefill(session, other * 3, chunk=16, progress=False)
    question = question_ids(session)
    after_other, full = restored_and_full(session, header, question, cache=restored)
    torch.testing.assert_close(after_other, full, rtol=1e-5, atol=1e-5)


def test_crop_is_refused_whole_prefix_reuses(session, tmp_path):
    assert_reusable_only_whole(session, save_prefix(session, context_ids(session, 40), tmp_path / "ctx.kv"))
