"""An artifact unpacked from the chunk store continues token-exact: it is the same file, byte for
byte, and ``kvcdn verify`` on it gives what verify gives on the original. One tiny model per
architecture family (full attention, sliding window, MLA, recurrent state, hybrid), and SmolLM2-135M's
real weights (slow)."""

from __future__ import annotations

import importlib
import json

import pytest

from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.model.tiny import SAMPLE_TEXT
from kvcdn_core.store.chunkstore import ChunkStore

QUESTION = " And then?"

FAMILIES = [
    ("kvcdn_model_qwen", "QwenAdapter", "Qwen3ForCausalLM"),
    ("kvcdn_model_gemma", "GemmaAdapter", "Gemma2ForCausalLM"),
    ("kvcdn_model_deepseek", "DeepseekAdapter", "DeepseekV3ForCausalLM"),
    ("kvcdn_model_ssm", "SSMAdapter", "MambaForCausalLM"),
    ("kvcdn_model_hybrid", "HybridAdapter", "JambaForCausalLM"),
]


def unpacked(store_dir, source, tmp_path):
    store = ChunkStore(LocalStorage(store_dir))
    store.put(source, "doc")
    out = tmp_path / "unpacked.kv"
    store.get("doc", out)
    assert out.read_bytes() == source.read_bytes()
    return out, store.record("doc")


def verify(cli, path, model, n=8):
    result = cli(
        "verify", "--kv-path", path, "--model", model, "--question", QUESTION, "--n", n, "-q", "--format", "json"
    )
    assert result.exit_code in (0, 1), result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("module,cls,architecture", FAMILIES, ids=[f[2] for f in FAMILIES])
def test_verify_on_an_unpacked_artifact_is_token_exact(module, cls, architecture, tiny_session, tmp_path, cli):
    from kvcdn_core import runtime

    adapter_cls = getattr(importlib.import_module(module), cls)
    session = tiny_session(adapter_cls, architecture)
    source = tmp_path / "doc.kv"
    _, ids = runtime.generate(session, SAMPLE_TEXT, source, chunk=100, progress=False)
    assert len(ids) > 256, "the artifact must span several chunks"
    out, record = unpacked(tmp_path / "store", source, tmp_path)
    if record.reuse == "any_prefix":
        assert len(record.chunks) == -(-len(ids) // 256)
    model = session.model_ref
    got, original = verify(cli, out, model), verify(cli, source, model)
    assert got["status"] == "PASS" and got["matches"] == 8, got
    assert got["cached_ids"] == original["cached_ids"] and got["reference_ids"] == original["reference_ids"]


@pytest.mark.slow
def test_smollm2_real_weights_token_exact_from_the_store(tmp_path, cli):
    from kvcdn_core.testing.smollm2 import smollm2_dir

    model = smollm2_dir()
    context = tmp_path / "context.txt"
    context.write_text(SAMPLE_TEXT, encoding="utf-8")
    source = tmp_path / "doc.kv"
    result = cli("generate", "--model", model, "--context-file", context, "-o", source, "-q")
    assert result.exit_code == 0, result.stderr
    out, record = unpacked(tmp_path / "store", source, tmp_path)
    assert len(record.chunks) >= 2
    result = cli(
        "verify",
        "--kv-path",
        out,
        "--model",
        model,
        "--question",
        "\n\nQ: What happened in 1887?\nA:",
        "--n",
        32,
        "-q",
        "--format",
        "json",
    )
    got = json.loads(result.stdout)
    assert result.exit_code == 0 and got["status"] == "PASS" and got["matches"] == 32, got
