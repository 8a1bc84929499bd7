"""continue / verify / diag with several --kv-path: composing cached documents, as a user runs it."""

from __future__ import annotations

import json

import pytest

from kvcdn_core.model.tiny import SAMPLE_TEXT

DOCUMENTS = [p.strip() for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
QUESTION = "\n\nQ: Which ship was lost?\nA:"


@pytest.fixture(scope="module")
def documents(qwen3_dir, tmp_path_factory):
    """Three artifacts of the tiny Qwen3, one per paragraph of the sample text."""
    from kvcdn_core import runtime

    session = runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")
    out = tmp_path_factory.mktemp("compose-cli")
    return [
        runtime.generate(session, text, out / f"doc{i}.kv", progress=False)[0] for i, text in enumerate(DOCUMENTS[:3])
    ]


def _kv(paths):
    return [arg for p in paths for arg in ("--kv-path", p)]


def test_continue_composes_in_the_order_given(cli, documents):
    order = [documents[2], documents[0], documents[1]]
    result = cli("continue", *_kv(order), "--question", QUESTION, "--recompute", "0.3", "--n", "6", "--format", "json")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["paths"] == [str(p) for p in order]
    assert out["documents"] == 3 and out["offsets"][0] == 0
    assert out["rule"] == "deviation" and out["recompute"] == 0.3
    later = out["context_tokens"] - out["offsets"][1]
    assert out["recomputed_tokens"] == round(0.3 * later)
    assert len(out["token_ids"]) == 6


def test_continue_at_recompute_one_is_the_full_prefill(cli, documents):
    """The composed continuation at R = 1 equals verify's full prefill of the same documents."""
    composed = cli(
        "continue", *_kv(documents), "--question", QUESTION, "--recompute", "1", "--n", "8", "--format", "json"
    )
    assert composed.exit_code == 0, composed.stderr
    checked = cli("verify", *_kv(documents), "--question", QUESTION, "--recompute", "1", "--n", "8", "--format", "json")
    assert checked.exit_code == 0, checked.stdout
    verdict = json.loads(checked.stdout)
    assert verdict["status"] == "PASS"
    assert json.loads(composed.stdout)["token_ids"] == verdict["reference_ids"]


def test_one_kv_path_is_unchanged(cli, documents):
    """One --kv-path is today's continuation: the same output keys, and no composition knobs."""
    result = cli("continue", "--kv-path", documents[0], "--n", "4", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert set(json.loads(result.stdout)) == {
        "path",
        "model",
        "reused_tokens",
        "question_tokens",
        "token_ids",
        "text",
    }
    result = cli("continue", "--kv-path", documents[0], "--recompute", "0.5")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --recompute and --select compose several artifacts: pass two or more --kv-path"
    )


def test_diag_reports_the_composition_against_the_full_prefill(cli, documents):
    result = cli(
        "diag", *_kv(documents[::-1]), "--question", QUESTION, "--recompute", "0", "--n", "4", "--format", "json"
    )
    assert result.exit_code == 1  # positions moved, nothing recomputed: not the full prefill's logits
    out = json.loads(result.stdout)
    assert out["recomputed_tokens"] == 0 and out["status"] == "FAIL"
    assert out["mean_kl"] > 0 and 0 <= out["mean_top5_overlap"] <= 1
    assert set(out) >= {"argmax_agree", "first_divergence", "max_kl", "steps"}
    result = cli("diag", *_kv(documents[::-1]), "--question", QUESTION, "--recompute", "1", "--n", "4")
    assert result.exit_code == 0, result.stdout
    assert "first divergence: none" in result.stdout


def test_verify_text_names_the_composition(cli, documents):
    result = cli("verify", *_kv(documents[:2]), "--recompute", "1", "--n", "4", "--select", "doc-start")
    assert result.exit_code == 0, result.stdout
    assert "composed 2 artifacts" in result.stdout
    assert "token match: 4/4 (PASS)" in result.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--recompute", "1.5"), "Invalid value for '--recompute'"),
        (("--select", "random"), "Invalid value for '--select'"),
        (("--kv-path", "missing.kv"), "--kv-path 'missing.kv' does not exist"),
    ],
)
def test_bad_composition_input_is_one_line(cli, documents, extra, message):
    result = cli("continue", *_kv(documents[:2]), *extra)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_artifacts_of_another_model_are_refused(cli, documents, qwen2_dir, tmp_path, context_file):
    other = tmp_path / "other.kv"
    assert cli("generate", "--model", qwen2_dir, "--context-file", context_file, "--output", other, "-q").exit_code == 0
    result = cli("continue", "--kv-path", documents[0], "--kv-path", other)
    assert result.exit_code == 2
    assert "made with different models" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_diag_auto_picks_the_smallest_share_within_max_kl(cli, documents):
    args = ("diag", *_kv(documents[::-1]), "--question", QUESTION, "--n", "4", "--format", "json")
    out = json.loads(cli(*args, "--recompute", "auto", "--max-kl", "1e-9").stdout)
    shares = [t["recompute"] for t in out["tried"]]
    assert shares == sorted(shares) and shares[0] == 0
    assert all(t["mean_kl"] > 1e-9 for t in out["tried"][:-1])
    assert out["tried"][-1]["mean_kl"] <= 1e-9 and out["status"] == "PASS"
    assert out["recompute"] == shares[-1] and out["mean_kl"] == out["tried"][-1]["mean_kl"]
    loose = json.loads(cli(*args, "--recompute", "auto", "--max-kl", "100").stdout)
    assert [t["recompute"] for t in loose["tried"]] == [0.0] and loose["recomputed_tokens"] == 0


@pytest.mark.parametrize(
    "extra", [("--recompute", "auto"), ("--max-kl", "0.1"), ("--recompute", "0.2", "--max-kl", "0.1")]
)
def test_diag_auto_and_max_kl_go_together(cli, documents, extra):
    result = cli("diag", *_kv(documents[:2]), *extra)
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --recompute auto and --max-kl go together"


def test_auto_is_for_diag_only(cli, documents):
    result = cli("continue", *_kv(documents[:2]), "--recompute", "auto")
    assert result.exit_code == 2 and "Invalid value for '--recompute'" in result.stderr


def _artifacts(cli, tiny_model, architecture, out):
    """The tiny model of ``architecture`` and an artifact per sample paragraph, made by the CLI."""
    from kvcdn_core.plugin_host.registry import adapter_classes

    model = tiny_model(adapter_classes()[architecture], architecture)
    paths = []
    for i, text in enumerate(DOCUMENTS[:3]):
        (out / f"doc{i}.txt").write_text(text)
        path = out / f"doc{i}.kv"
        made = cli(
            "generate", "--model", str(model), "--context-file", str(out / f"doc{i}.txt"), "--output", str(path), "-q"
        )
        assert made.exit_code == 0, made.stderr
        paths.append(str(path))
    return paths


def test_a_latent_attention_composition_verifies_at_recompute_one(cli, tiny_model, tmp_path):
    """DeepSeek-V3.2 (MLA with the DSA indexer): moved, recomputed and checked as a user runs it."""
    paths = _artifacts(cli, tiny_model, "DeepseekV32ForCausalLM", tmp_path)
    checked = cli("verify", *_kv(paths), "--question", QUESTION, "--recompute", "1", "--n", "6", "--format", "json")
    assert checked.exit_code == 0, checked.stdout
    assert json.loads(checked.stdout)["status"] == "PASS"
    moved = cli("continue", *_kv(paths[::-1]), "--question", QUESTION, "--recompute", "0.3", "--n", "4")
    assert moved.exit_code == 0, moved.stderr
    assert "composed 3 artifacts" in moved.stderr


def test_a_composition_past_a_sliding_window_is_refused_in_one_line(cli, tiny_model, tmp_path):
    """The tiny Mistral's 20-token window holds less than the documents: one line, exit non-zero."""
    paths = _artifacts(cli, tiny_model, "MistralForCausalLM", tmp_path)
    result = cli("continue", *_kv(paths), "--question", QUESTION, "--n", "4")
    assert result.exit_code != 0
    assert "sliding window that keeps only the last 19" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
