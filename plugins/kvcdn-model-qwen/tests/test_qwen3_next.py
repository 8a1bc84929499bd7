"""Qwen3-Next (gated-DeltaNet linear attention + full attention) and cropping restored caches.

The adapter contract for Qwen3-Next runs in test_qwen_contract.py (it is one of QwenAdapter's
validation configs); these tests check what is specific to linear-attention layers, against a full
prefill of the same token ids in float32.
"""

import pytest
import torch
from kvcdn_model_qwen import QwenAdapter

from kvcdn_core import LayerEntry, Manifest, artifact, runtime
from kvcdn_core.errors import KvcdnError
from kvcdn_core.exactness.architecture import long_context
from kvcdn_core.testing import assert_chunked_prefill_exact

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

NEXT = "Qwen3NextForCausalLM"


@pytest.fixture(scope="module")
def session_of(tiny_session):
    return lambda architecture: tiny_session(QwenAdapter, architecture)


def ids_of(session, n_tokens):
    return session.adapter.encode_context(session.tokenizer, long_context(n_tokens, session.tokenizer))


def saved(session, ids, tmp_path):
    cache, _ = runtime.prefill(session, ids, chunk=64, progress=False)
    path = runtime.save_cache(session, cache, ids, "ctx", tmp_path / "ctx.kv")
    return artifact.read_header(path)


def question_ids(session):
    ids = session.adapter.encode_continuation(session.tokenizer, " Which ship was missing, and where?")
    assert len(ids) > 4
    return ids


def test_manifest_records_linear_and_full_layers(session_of, tmp_path):
    session = session_of(NEXT)
    header = saved(session, ids_of(session, 40), tmp_path)
    manifest = header.manifest
    assert [layer["kind"] for layer in manifest["layers"]] == [
        artifact.LINEAR_ATTENTION,
        artifact.LINEAR_ATTENTION,
        artifact.LINEAR_ATTENTION,
        artifact.FULL_ATTENTION,
    ]
    assert manifest["reuse"] == "whole_prefix"
    linear, full = manifest["layers"][0], manifest["layers"][3]
    assert set(linear["tensors"]) == {"conv_state", "recurrent_state"}
    assert linear["conv_kernel"] == 4
    assert set(full["tensors"]) == {"key", "value"}
    assert manifest["tensors"][full["tensors"]["key"]]["shape"][2] == header.token_count


def test_chunked_prefill_gives_the_one_pass_state(session_of):
    session = session_of(NEXT)
    assert_chunked_prefill_exact(session, ids_of(session, 150), chunk=64)


def test_multi_token_question_on_restored_state(session_of, tmp_path):
    session = session_of(NEXT)
    ids = ids_of(session, 150)
    question = question_ids(session)
    restored, restored_ids = runtime.load_cache(session, saved(session, ids, tmp_path))
    assert restored_ids == ids
    with torch.inference_mode():
        cached, _ = session.adapter.forward(session.model, torch.tensor([question]), restored)
        full, _ = session.adapter.forward(
            session.model, torch.tensor([ids + question]), session.adapter.new_cache(session.model)
        )
    full = full[:, len(ids) :]
    # The chunked delta rule sums in 64-token blocks aligned to the start of each call, so float32
    # rounding differs by ~2e-4 on logits of magnitude ~10; a lost state differs by ~4.
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-3)
    assert torch.equal(cached.argmax(-1), full.argmax(-1))
    # Control: the same check on a state that lost its linear-attention memory fails clearly.
    broken, _ = runtime.load_cache(session, artifact.read_header(tmp_path / "ctx.kv"))
    for layer in broken.layers[:3]:
        layer.recurrent_states[0].zero_()
    with torch.inference_mode():
        wrong, _ = session.adapter.forward(session.model, torch.tensor([question]), broken)
    assert float((wrong - full).abs().max()) > 0.1


def test_crop_refuses_linear_attention(session_of, tmp_path):
    session = session_of(NEXT)
    ids = ids_of(session, 40)
    header = saved(session, ids, tmp_path)
    restored, _ = runtime.load_cache(session, header)
    layers = Manifest.from_dict(header.manifest).layers
    with pytest.raises(KvcdnError, match="layer 0 is 'linear_attention'"):
        session.adapter.crop(restored, layers, len(ids) - 3)
    # Nothing was cut: the full-attention layer still holds every token, the whole prefix reuses.
    assert restored.layers[3].keys.shape[-2] == len(ids)
    assert session.adapter.crop(restored, layers, len(ids)) is restored


def test_crop_full_attention_equals_a_shorter_prefill(session_of, tmp_path):
    """The croppable case of the same contract: a cropped Qwen3 cache continues like a fresh prefill."""
    session = session_of("Qwen3ForCausalLM")
    ids = ids_of(session, 60)
    header = saved(session, ids, tmp_path)
    assert header.manifest["reuse"] == "any_prefix"
    restored, _ = runtime.load_cache(session, header)
    keep = len(ids) - 17
    session.adapter.crop(restored, Manifest.from_dict(header.manifest).layers, keep)
    assert restored.get_seq_length() == keep
    question = question_ids(session)
    with torch.inference_mode():
        cropped, _ = session.adapter.forward(session.model, torch.tensor([question]), restored)
        full, _ = session.adapter.forward(
            session.model, torch.tensor([ids[:keep] + question]), session.adapter.new_cache(session.model)
        )
    torch.testing.assert_close(cropped, full[:, keep:], rtol=1e-4, atol=1e-4)
    with pytest.raises(KvcdnError, match="cannot crop"):
        session.adapter.crop(restored, Manifest.from_dict(header.manifest).layers, 0)


def test_crop_refuses_sliding_window(tmp_path):
    """Sliding-window layers keep only the last window: a shorter prefix is refused by kind."""
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    layer = DynamicSlidingWindowLayer(sliding_window=8)
    layer.update(torch.zeros(1, 1, 20, 4), torch.zeros(1, 1, 20, 4))
    cache = DynamicCache()
    cache.layers = [layer]
    layers = [LayerEntry(0, artifact.SLIDING_WINDOW, window=8, cumulative_length=20)]
    with pytest.raises(KvcdnError, match="'sliding_window'"):
        QwenAdapter().crop(cache, layers, 10, token_count=20)


def test_bfloat16_keeps_the_float32_delta_state(tiny_model, tmp_path):
    """Under bfloat16 the DeltaNet memory stays float32 in the model, in the file and after loading."""
    path = tiny_model(QwenAdapter, NEXT)
    session = runtime.load_session(str(path), device="cpu", dtype="bfloat16", adapter_cls=QwenAdapter)
    ids = ids_of(session, 40)
    header = saved(session, ids, tmp_path)
    linear = header.manifest["layers"][0]["tensors"]
    assert header.manifest["tensors"][linear["recurrent_state"]]["dtype"] == "F32"
    assert header.manifest["tensors"][linear["conv_state"]]["dtype"] == "BF16"
    restored, _ = runtime.load_cache(session, header)
    assert restored.layers[0].recurrent_states[0].dtype == torch.float32
    assert restored.layers[3].keys.dtype == torch.bfloat16
