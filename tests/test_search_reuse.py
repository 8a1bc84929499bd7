"""Reusing a saved prefix (``continue --dir``, ``search --tree``) against a full prefill of the same
token ids, in float32, on a full-attention (Qwen3) and a sliding-window (Qwen2, window 24) tiny model.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from kvcdn_model_qwen import QwenAdapter

from kvcdn_core import artifact, runtime, search
from kvcdn_core.artifact.manifest import Manifest
from kvcdn_core.cli.app import make_cli
from kvcdn_core.errors import KvcdnError
from kvcdn_core.model.tiny import SAMPLE_TEXT

PARAS = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
QUESTION = "\n\nQ: What did the keeper write down?\nA:"
N = 12


class SlidingQwen(QwenAdapter):
    """Qwen2 whose every layer is a 24-token sliding window."""

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
    path = tiny_model(QwenAdapter, "Qwen3ForCausalLM")
    return runtime.load_session(str(path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def sliding(tiny_model):
    path = tiny_model(SlidingQwen, "Qwen2ForCausalLM")
    return runtime.load_session(str(path), device="cpu", dtype="float32")


def encode(session, text):
    return session.adapter.encode_context(session.tokenizer, text)


def reference(session, ids, n=N):
    """A full prefill of ``ids`` in one pass, then greedy decoding."""
    tokens, _ = runtime.greedy(session, session.adapter.new_cache(session.model), list(ids), n)
    return tokens


def continue_from(session, directory, prompt, n=N):
    found = search.search(directory, prompt, session.model_ref, warn=pytest.fail)
    found = found.retokenized(session.tokenizer, session.fingerprint)
    pre = search.prefill_reusing(session, found.ranking, found.query_ids)
    return found, pre, runtime.decode_from(session, pre.cache, pre.logits, n)[0]


@pytest.mark.parametrize("case", ["longer", "strict_prefix", "exact"])
def test_full_attention_continue_is_exact(full, tmp_path, case):
    prompt = PARAS[0] + QUESTION
    saved = {"longer": PARAS[0] + "\n\n" + PARAS[1], "strict_prefix": PARAS[0], "exact": prompt}[case]
    runtime.generate(full, saved, tmp_path / "arts" / "saved.kv", progress=False)
    runtime.generate(full, PARAS[2], tmp_path / "arts" / "unrelated.kv", progress=False)
    ids, saved_ids = encode(full, prompt), encode(full, saved)
    prefix = search.common_prefix(ids, saved_ids)
    expected_reuse = {"longer": prefix, "strict_prefix": len(saved_ids), "exact": len(ids) - 1}[case]
    if case == "longer":
        assert prefix < len(saved_ids)  # the artifact is cropped
    if case == "strict_prefix":
        assert prefix == len(saved_ids) < len(ids)
    found, pre, tokens = continue_from(full, tmp_path / "arts", prompt)
    assert pre.path.name == "saved.kv" and pre.reused_tokens == expected_reuse > 40
    assert pre.prefilled_tokens == len(ids) - expected_reuse
    assert tokens == reference(full, ids)


def test_continue_cli_reports_reuse_and_keeps_kv_path_mode(full, tmp_path):
    runtime.generate(full, PARAS[0] + "\n\n" + PARAS[1], tmp_path / "arts" / "long.kv", progress=False)
    prompt = PARAS[0] + QUESTION
    (tmp_path / "prompt.txt").write_text(prompt)
    runner = CliRunner()
    args = [
        "continue",
        "--dir",
        str(tmp_path / "arts"),
        "--prompt-file",
        str(tmp_path / "prompt.txt"),
        "--n",
        str(N),
        "-q",
    ]
    result = runner.invoke(make_cli(), args + ["--format", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    ids = encode(full, prompt)
    assert out["reused_tokens"] == search.common_prefix(ids, encode(full, PARAS[0] + "\n\n" + PARAS[1]))
    assert out["prompt_tokens"] == len(ids) and out["token_ids"] == reference(full, ids)
    table = runner.invoke(make_cli(), args)
    assert table.exit_code == 0
    assert f"reused {out['reused_tokens']} of {len(ids)} prompt tokens from " in table.output

    old = runner.invoke(
        make_cli(),
        [
            "continue",
            "--kv-path",
            str(tmp_path / "arts" / "long.kv"),
            "--n",
            "4",
            "--question",
            "Q:",
            "--format",
            "json",
        ],
    )
    assert old.exit_code == 0, old.output
    long_ids = artifact.read_token_ids(tmp_path / "arts" / "long.kv")
    assert json.loads(old.output)["token_ids"] == reference(
        full, long_ids + full.adapter.encode_continuation(full.tokenizer, "Q:"), 4
    )
    both = runner.invoke(make_cli(), args + ["--kv-path", "x.kv"])
    assert both.exit_code == 2 and "two modes" in both.output


def test_tree_gives_n_distinct_exact_candidates(full, tmp_path):
    runtime.generate(full, PARAS[0] + "\n\n" + PARAS[1], tmp_path / "long.kv", progress=False)
    prompt = PARAS[0] + QUESTION
    ids = encode(full, prompt)
    found = search.search(tmp_path, prompt, full.model_ref, warn=pytest.fail)
    pre = search.prefill_reusing(full, found.ranking, found.query_ids)
    assert pre.reused_tokens > 40 and pre.path.name == "long.kv"
    candidates = search.tree(full, pre, 4, 6)
    firsts = [c.token_ids[0] for c in candidates]
    assert len(set(firsts)) == 4 and len({tuple(c.token_ids) for c in candidates}) == 4
    import torch

    _, ref_logits = runtime.greedy(full, full.adapter.new_cache(full.model), ids, 1)
    ref_logprobs = torch.log_softmax(ref_logits[0].double(), -1)
    assert firsts == torch.topk(ref_logprobs, 4).indices.tolist()
    for c in candidates:
        assert len(c.token_ids) == 6
        assert c.first_token_logprob == pytest.approx(float(ref_logprobs[c.token_ids[0]]), abs=1e-4)
        # each branch continues exactly as a full prefill of prompt + its first token would
        assert c.token_ids[1:] == reference(full, ids + [c.token_ids[0]], 5)
    assert [c.first_token_logprob for c in candidates] == sorted(
        (c.first_token_logprob for c in candidates), reverse=True
    )


def test_tree_branches_share_the_prefix_cache(full):
    cache, _ = runtime.prefill(full, encode(full, PARAS[0]), progress=False)
    before = [layer.keys.data_ptr() for layer in cache.layers]
    full.adapter.share_across_batch(cache, 3)
    assert [layer.keys.data_ptr() for layer in cache.layers] == before  # views, not copies
    assert all(layer.keys.shape[0] == 3 and layer.keys.stride(0) == 0 for layer in cache.layers)


def test_tree_cli_json_and_from_scratch(full, tmp_path):
    runtime.generate(full, PARAS[0], tmp_path / "a.kv", progress=False)
    runner = CliRunner()
    base = ["search", "--dir", str(tmp_path), "--tree", "3", "--tree-tokens", "4", "--format", "json", "-q"]
    out = json.loads(runner.invoke(make_cli(), base + ["--prompt", PARAS[0] + QUESTION]).output)
    tree = out["tree"]
    assert tree["from_scratch"] is False and tree["reused_tokens"] == len(encode(full, PARAS[0]))
    assert len({c["first_token"] for c in tree["candidates"]}) == 3
    assert all(len(c["token_ids"]) == 4 and isinstance(c["text"], str) for c in tree["candidates"])
    result = runner.invoke(make_cli(), base[:-1] + ["--format", "table", "--prompt", "zebra quantum"])
    assert result.exit_code == 0
    assert "prefilled all" in result.output and "from scratch" in result.output
    assert sum(line.startswith("[") for line in result.output.splitlines()) == 3


def test_sliding_window_whole_prefix_is_exact(sliding, tmp_path):
    prompt = PARAS[0] + QUESTION
    runtime.generate(sliding, PARAS[0], tmp_path / "prefix.kv", progress=False)
    saved = encode(sliding, PARAS[0])
    assert len(saved) > 2 * 24 and artifact.read_manifest(tmp_path / "prefix.kv")["reuse"] == "whole_prefix"
    found, pre, tokens = continue_from(sliding, tmp_path, prompt)
    assert pre.reused_tokens == len(saved)
    assert tokens == reference(sliding, encode(sliding, prompt))
    candidates = search.tree(sliding, search.prefill_reusing(sliding, found.ranking, found.query_ids), 3, 5)
    ids = encode(sliding, prompt)
    for c in candidates:  # branching on a sliding cache past its window stays exact
        assert c.token_ids[1:] == reference(sliding, ids + [c.token_ids[0]], 4)


def test_sliding_window_partial_prefix_is_not_reused(sliding, tmp_path):
    prompt = PARAS[0] + QUESTION
    runtime.generate(sliding, PARAS[0] + "\n\n" + PARAS[1], tmp_path / "longer.kv", progress=False)
    found = search.search(tmp_path, prompt, sliding.model_ref, warn=pytest.fail)
    [match] = found.ranking.matches
    assert match.prefix_tokens > 40 and match.usable_tokens == 0 and match.entry.reuse == "whole_prefix"
    _, pre, tokens = continue_from(sliding, tmp_path, prompt)
    assert pre.path is None and pre.reused_tokens == 0
    assert tokens == reference(sliding, encode(sliding, prompt))


def test_crop_refuses_sliding_layers(sliding, tmp_path):
    runtime.generate(sliding, PARAS[0], tmp_path / "a.kv", progress=False)
    header = artifact.read_header(tmp_path / "a.kv")
    cache, ids = runtime.load_cache(sliding, header)
    with pytest.raises(KvcdnError, match="sliding_window"):
        sliding.adapter.crop(cache, Manifest.from_dict(header.manifest).layers, len(ids) // 2, token_count=len(ids))


@pytest.mark.slow
def test_tree_and_reuse_on_a_recurrent_model(tiny_model, tmp_path):
    """Mamba: whole-prefix reuse, and branches copied per row (recurrent states update in place)."""
    from kvcdn_core.plugin_host.registry import adapter_classes

    pytest.importorskip("kvcdn_model_ssm", reason="the ssm family plugin (plugins/kvcdn-model-ssm) is not installed")
    adapter_cls = adapter_classes()["MambaForCausalLM"]
    session = runtime.load_session(str(tiny_model(adapter_cls, "MambaForCausalLM")), device="cpu", dtype="float32")
    runtime.generate(session, PARAS[0], tmp_path / "prefix.kv", progress=False)
    runtime.generate(session, PARAS[0] + "\n\n" + PARAS[1], tmp_path / "longer.kv", progress=False)
    prompt = PARAS[0] + QUESTION
    ids = encode(session, prompt)
    found, pre, tokens = continue_from(session, tmp_path, prompt)
    assert [(m.path.name, m.usable_tokens) for m in found.ranking.matches] == [
        ("prefix.kv", len(encode(session, PARAS[0]))),
        ("longer.kv", 0),
    ]
    assert pre.path.name == "prefix.kv" and tokens == reference(session, ids)
    candidates = search.tree(session, search.prefill_reusing(session, found.ranking, found.query_ids), 3, 4)
    assert len({c.token_ids[0] for c in candidates}) == 3
    for c in candidates:
        assert c.token_ids[1:] == reference(session, ids + [c.token_ids[0]], 3)
