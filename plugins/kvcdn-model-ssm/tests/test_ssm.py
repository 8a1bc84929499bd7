"""Mamba, Mamba2 and FalconMamba: recurrent-state artifacts are exact and refuse to be cropped.

Every check compares against a full prefill of the same token ids in float32.
"""

import dataclasses

import pytest
import torch
from kvcdn_model_ssm import SSMAdapter

from kvcdn_core import Manifest, ModelAdapter, artifact, runtime
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.exactness.architecture import long_context
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family

ARCHITECTURES = sorted(SSMAdapter.validation_configs)


@pytest.fixture(scope="module")
def sessions(tiny_session):
    """architecture → a loaded float32 session of its tiny model."""
    return lambda architecture: tiny_session(SSMAdapter, architecture)


def context_ids(session, n_tokens=150):
    text = long_context(n_tokens, session.tokenizer)
    return session.adapter.encode_context(session.tokenizer, text)


def states(session, cache):
    _, tensors = session.adapter.export_cache(session.model, cache)
    return tensors


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(SSMAdapter, architecture, tmp_path)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_chunked_prefill_gives_the_one_pass_state(architecture, sessions):
    session = sessions(architecture)
    ids = context_ids(session)
    one_cache, one_logits = runtime.prefill(session, ids, chunk=len(ids), progress=False)
    chunk_cache, chunk_logits = runtime.prefill(session, ids, chunk=64, progress=False)
    one, chunked = states(session, one_cache), states(session, chunk_cache)
    assert sorted(one) == sorted(chunked)
    for name in one:
        torch.testing.assert_close(chunked[name], one[name], rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(chunk_logits, one_logits, rtol=1e-4, atol=1e-4)


def fresh_session(tiny_model, architecture, dtype="float32"):
    """A session whose model no test has run yet (the adapter wraps mixers on first use)."""
    path = tiny_model(SSMAdapter, architecture)
    return runtime.load_session(str(path), device="cpu", dtype=dtype, adapter_cls=SSMAdapter)


@pytest.mark.parametrize("architecture", ["MambaForCausalLM", "FalconMambaForCausalLM"])
def test_base_forward_drops_the_state(architecture, tiny_model):
    """Control: transformers' own multi-token path restarts from zeros; the plugin's does not."""
    session = fresh_session(tiny_model, architecture)
    ids = context_ids(session)
    base = ModelAdapter()
    with torch.inference_mode():
        cache = session.adapter.new_cache(session.model)
        for start in range(0, len(ids), 64):
            piece = torch.tensor([ids[start : start + 64]])
            logits, cache = base.forward(session.model, piece, cache)
    assert not hasattr(session.model, "_kvcdn_seeded_mixers")
    _, one_logits = runtime.prefill(session, ids, chunk=len(ids), progress=False)
    assert float((logits[0, -1] - one_logits).abs().max()) > 1e-2


@pytest.mark.parametrize("architecture", ["MambaForCausalLM", "FalconMambaForCausalLM"])
def test_token_by_token_fallback(architecture, tiny_model, monkeypatch):
    """A mixer the seeded scan does not know is fed one token at a time: slower, equally exact."""
    from kvcdn_model_ssm import scan

    monkeypatch.setattr(scan, "supports", lambda mixer: False)
    session = fresh_session(tiny_model, architecture)
    ids = context_ids(session)
    _, one_logits = runtime.prefill(session, ids, chunk=len(ids), progress=False)
    _, chunk_logits = runtime.prefill(session, ids, chunk=64, progress=False)
    assert session.model._kvcdn_seeded_mixers is False
    torch.testing.assert_close(chunk_logits, one_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_multi_token_question_on_restored_state(architecture, sessions, tmp_path):
    """Logits of a multi-token question fed on a loaded artifact equal those of a full prefill."""
    session = sessions(architecture)
    ids = context_ids(session)
    question = session.adapter.encode_continuation(session.tokenizer, " Which ship was missing, and where?")
    assert len(question) > 4
    cache, _ = runtime.prefill(session, ids, chunk=64, progress=False)
    path = runtime.save_cache(session, cache, ids, "ctx", tmp_path / "ctx.kv")
    restored, restored_ids = runtime.load_cache(session, artifact.read_header(path))
    assert restored_ids == ids
    with torch.inference_mode():
        cached, _ = session.adapter.forward(session.model, torch.tensor([question]), restored)
        full, _ = session.adapter.forward(
            session.model, torch.tensor([ids + question]), session.adapter.new_cache(session.model)
        )
    full = full[:, len(ids) :]
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    assert torch.equal(cached.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_manifest_says_recurrent_whole_prefix(architecture, sessions, tmp_path):
    session = sessions(architecture)
    ids = context_ids(session, 40)
    cache, _ = runtime.prefill(session, ids, progress=False)
    path = runtime.save_cache(session, cache, ids, "ctx", tmp_path / "a.kv")
    manifest = artifact.read_manifest(path)
    assert manifest["reuse"] == "whole_prefix"
    layers = manifest["layers"]
    assert len(layers) == session.model.config.num_hidden_layers
    for layer in layers:
        assert layer["kind"] == artifact.RECURRENT_STATE
        assert set(layer["tensors"]) == {"conv_state", "recurrent_state"}
        assert layer["conv_kernel"] == session.model.config.conv_kernel
        conv = manifest["tensors"][layer["tensors"]["conv_state"]]
        assert conv["shape"][-1] == session.model.config.conv_kernel


def test_crop_refuses_a_recurrent_state(sessions, tmp_path):
    session = sessions("MambaForCausalLM")
    ids = context_ids(session, 40)
    cache, _ = runtime.prefill(session, ids, progress=False)
    path = runtime.save_cache(session, cache, ids, "ctx", tmp_path / "a.kv")
    header = artifact.read_header(path)
    restored, _ = runtime.load_cache(session, header)
    layers = Manifest.from_dict(header.manifest).layers
    before = states(session, restored)
    with pytest.raises(KvcdnError, match="recurrent_state"):
        session.adapter.crop(restored, layers, len(ids) - 1, header.token_count)
    # Refused before touching anything; the whole prefix still works.
    after = states(session, restored)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert session.adapter.crop(restored, layers, len(ids), header.token_count) is restored
    with pytest.raises(KvcdnError, match="no attention layer"):
        session.adapter.crop(restored, layers, 5)
    with pytest.raises(KvcdnError, match="cannot crop"):
        session.adapter.crop(restored, layers, len(ids) + 1, header.token_count)


def test_an_attention_cache_is_not_a_recurrent_state(sessions):
    from transformers.cache_utils import DynamicLayer

    with pytest.raises(KvcdnError, match="not a recurrent state"):
        SSMAdapter().layer_kind(DynamicLayer())


def test_import_refuses_another_layer_kind(sessions, tmp_path):
    session = sessions("Mamba2ForCausalLM")
    ids = context_ids(session, 40)
    cache, _ = runtime.prefill(session, ids, progress=False)
    layers, tensors = session.adapter.export_cache(session.model, cache)
    layers[1] = dataclasses.replace(layers[1], kind=artifact.LINEAR_ATTENTION)
    with pytest.raises(ArtifactError, match="'linear_attention' in the artifact"):
        session.adapter.import_cache(session.model, layers, tensors, "cpu")


def test_bfloat16_restores_the_float32_state(tiny_model, tmp_path):
    """Under bfloat16 the model keeps its SSM state in float32; loading must not narrow it."""
    from kvcdn_core.exactness.against_prefill import run_verify

    session = fresh_session(tiny_model, "MambaForCausalLM", dtype="bfloat16")
    ids = context_ids(session, 150)
    cache, _ = runtime.prefill(session, ids, chunk=64, progress=False)
    path = runtime.save_cache(session, cache, ids, "ctx", tmp_path / "bf16.kv")
    header = artifact.read_header(path)
    assert header.manifest["compute_dtype"] == "bfloat16"
    restored, _ = runtime.load_cache(session, header)
    for layer in restored.layers:
        assert layer.recurrent_states[0].dtype == torch.float32
        assert layer.conv_states[0].dtype == torch.bfloat16
    result = run_verify(session, header, "\n\nQ: Summarize the key claim in one sentence.\nA:", 32)
    assert result.passed, result.as_dict()
