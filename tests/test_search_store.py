"""``search --store`` and ``continue --store``: the prompt is looked up in a chunk store's prefix index,
the best artifact fetched through the chunk store, and the continuation is token-exact against a
full prefill (float32, greedy), as ``--dir`` is (tests/test_search_reuse.py).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from kvcdn_model_qwen import QwenAdapter

from kvcdn_core import runtime, search
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.cli.app import make_cli
from kvcdn_core.model.tiny import SAMPLE_TEXT
from kvcdn_core.store import index
from kvcdn_core.store.chunkstore import ChunkStore

PARAS = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
QUESTION = "\n\nQ: What did the keeper write down?\nA:"
N = 12


class SlidingQwen(QwenAdapter):
    validation_configs = {
        "Qwen2ForCausalLM": dict(
            QwenAdapter.validation_configs["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=24,
            max_window_layers=0,
            layer_types=["sliding_attention", "sliding_attention"],
        ),
    }


@pytest.fixture(scope="module")
def full(tiny_model):
    return runtime.load_session(str(tiny_model(QwenAdapter, "Qwen3ForCausalLM")), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def sliding(tiny_model):
    return runtime.load_session(str(tiny_model(SlidingQwen, "Qwen2ForCausalLM")), device="cpu", dtype="float32")


def encode(session, text):
    return session.adapter.encode_context(session.tokenizer, text)


def reference(session, ids, n=N):
    tokens, _ = runtime.greedy(session, session.adapter.new_cache(session.model), list(ids), n)
    return tokens


def put(session, tmp_path, store, name, text):
    path = tmp_path / "made" / f"{name}.kv"
    runtime.generate(session, text, path, progress=False)
    ChunkStore(LocalStorage(store)).put(path, name)


def cli(*args):
    result = CliRunner().invoke(make_cli(), [str(a) for a in args])
    return result


LONG = "\n\n".join(PARAS)  # several chunks of 256 tokens


@pytest.mark.parametrize("case", ["longer", "strict_prefix", "exact"])
def test_continue_from_the_store_is_exact(full, tmp_path, case):
    store = tmp_path / "store"
    prompt = LONG[: len(LONG) * 2 // 3] + QUESTION
    saved = {"longer": LONG, "strict_prefix": LONG[: len(LONG) * 2 // 3], "exact": prompt}[case]
    put(full, tmp_path, store, "saved", saved)
    put(full, tmp_path, store, "unrelated", PARAS[-1] + PARAS[0])
    ids, saved_ids = encode(full, prompt), encode(full, saved)
    assert len(saved_ids) > 256  # the match crosses a chunk boundary
    prefix = search.common_prefix(ids, saved_ids)
    expected = {"longer": prefix, "strict_prefix": len(saved_ids), "exact": len(ids) - 1}[case]
    (tmp_path / "prompt.txt").write_text(prompt)
    result = cli(
        "continue", "--store", store, "--prompt-file", tmp_path / "prompt.txt", "--n", N, "-q", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["artifact"] == "saved" and out["reused_tokens"] == expected
    assert out["token_ids"] == reference(full, ids)
    # search --store names the same artifact and prefix as search --dir over the same .kv files
    listed = cli("search", "--store", store, "--prompt-file", tmp_path / "prompt.txt", "--format", "json")
    assert listed.exit_code == 0, listed.output
    by_dir = cli("search", "--dir", tmp_path / "made", "--prompt-file", tmp_path / "prompt.txt", "--format", "json")
    best_store, best_dir = json.loads(listed.output)["matches"][0], json.loads(by_dir.output)["matches"][0]
    assert best_store["name"] == "saved" and best_dir["path"].endswith("saved.kv")
    assert (best_store["compute_dtype"], best_store["quantization"]) == ("float32", None)  # read from the record
    for field in ("prefix_tokens", "usable_tokens", "artifact_tokens"):
        assert best_store[field] == best_dir[field]


def test_whole_prefix_artifacts_from_the_store(sliding, tmp_path):
    store = tmp_path / "store"
    put(sliding, tmp_path, store, "para", PARAS[0])
    put(sliding, tmp_path, store, "both", PARAS[0] + "\n\n" + PARAS[1])  # longer than the prompt: unusable
    prompt = PARAS[0] + QUESTION
    (tmp_path / "prompt.txt").write_text(prompt)
    result = cli(
        "continue", "--store", store, "--prompt-file", tmp_path / "prompt.txt", "--n", N, "-q", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    ids = encode(sliding, prompt)
    assert out["artifact"] == "para" and out["reused_tokens"] == len(encode(sliding, PARAS[0]))
    assert out["token_ids"] == reference(sliding, ids)
    hits = index.lookup(LocalStorage(store), index.roots(LocalStorage(store))[0]["root"], ids)
    assert [h.name for h in hits] == ["para"]


def test_store_and_dir_are_one_or_the_other(tmp_path):
    for args in (
        ["search", "--store", tmp_path, "--dir", tmp_path, "--prompt", "x"],
        ["continue", "--store", tmp_path, "--dir", tmp_path, "--prompt-file", tmp_path / "p"],
        ["continue", "--store", tmp_path],
    ):
        result = cli(*args)
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output


def test_an_empty_store_asks_for_the_model(tmp_path):
    result = cli("search", "--store", tmp_path, "--prompt", "hello")
    assert result.exit_code == 2 and "pass --model" in result.output and result.output.count("\n") == 1


def test_search_store_tree_continues_from_the_fetched_artifact(full, tmp_path):
    store = tmp_path / "store"
    put(full, tmp_path, store, "long", LONG)
    prompt = LONG[: len(LONG) // 2] + QUESTION
    ids = encode(full, prompt)
    result = cli(
        "search", "--store", store, "--prompt", prompt, "--tree", 2, "--tree-tokens", 4, "-q", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    tree = json.loads(result.output)["tree"]
    assert tree["artifact"] == "long" and tree["reused_tokens"] == search.common_prefix(ids, encode(full, LONG))
    first = tree["candidates"][0]
    assert first["token_ids"] == reference(full, ids, 4)
