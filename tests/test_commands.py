"""generate / verify / diag / inspect / continue end to end on a tiny Qwen3, as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from kvcdn_core import artifact
from tests.support.budget import budget


def test_generate_then_verify_passes(cli, qwen3_dir, context_file, tmp_path):
    out = tmp_path / "doc.kv"
    result = cli("generate", "--model", qwen3_dir, "--context-file", context_file, "--output", out, "-q")
    assert result.exit_code == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    manifest = artifact.read_manifest(out)
    assert manifest["model"]["id"] == str(qwen3_dir)
    assert manifest["context"] == context_file.read_text()
    assert manifest["compute_dtype"] == "float32"

    # The model defaults to the one the manifest names; the context comes from the artifact.
    result = cli("verify", "--kv-path", out, "--n", "16")
    assert result.exit_code == 0, result.stderr
    assert "token match: 16/16 (PASS)" in result.stdout
    assert "first divergence: none" in result.stdout


def test_verify_generates_when_the_artifact_does_not_exist(cli, qwen3_dir, context_file, tmp_path):
    result = cli(
        "verify",
        "--model",
        qwen3_dir,
        "--context-file",
        context_file,
        "--n",
        "8",
        "--format",
        "json",
        "--kv-path",
        tmp_path / "new",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["status"] == "PASS" and data["matches"] == 8 and data["first_divergence"] is None
    assert data["reference_ids"] == data["cached_ids"]
    assert (tmp_path / "new.kv").exists()
    assert "appending '.kv'" in result.stderr


def test_default_output_goes_to_the_xdg_data_dir(cli, qwen3_dir, context_file, tmp_path):
    result = cli("generate", "--model", qwen3_dir, "--context-file", context_file, "-q", "--format", "json")
    path = json.loads(result.stdout)["path"]
    expected_dir = os.path.join(os.environ["XDG_DATA_HOME"], "kvcdn", "generate")
    assert os.path.dirname(path) == expected_dir
    name = os.path.basename(path)
    assert name.startswith("generate-") and name.endswith(
        f"-{qwen3_dir.name}.kv"
    )  # a local model: its directory's name


def test_tampered_artifact_fails_loudly(cli, qwen3_artifact, tmp_path):
    tampered = tmp_path / "tampered.kv"
    shutil.copy(qwen3_artifact, tampered)
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0x40
    tampered.write_bytes(bytes(data))
    result = cli("verify", "--kv-path", tampered, "--n", "4")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and "blake3 mismatch" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = cli("inspect", tampered, "--check")
    assert result.exit_code == 1 and "FAILED" in result.stdout


def test_truncated_artifact_is_a_one_line_error(cli, qwen3_artifact, tmp_path):
    cut = tmp_path / "cut.kv"
    cut.write_bytes(qwen3_artifact.read_bytes()[:5000])
    for args in (("inspect", cut), ("verify", "--kv-path", cut), ("continue", "--kv-path", cut)):
        result = cli(*args)
        assert result.exit_code == 2, args
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert "truncated" in result.stderr


def test_foreign_model_artifact_is_refused_unless_forced(cli, qwen3_artifact, qwen2_dir):
    result = cli("verify", "--kv-path", qwen3_artifact, "--model", qwen2_dir, "--n", "4")
    assert result.exit_code == 2
    assert "pass --force" in result.stderr and "architecture differs" in result.stderr


def test_diag_reports_per_step_logit_agreement(cli, qwen3_artifact):
    result = cli("diag", "--kv-path", qwen3_artifact, "--n", "6", "--format", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["steps"]) == 6 and data["status"] == "PASS"
    assert all(s["argmax_agree"] and s["top5_overlap"] == 1.0 for s in data["steps"])
    assert data["max_abs_logit_diff"] < 1e-3
    # An impossible threshold turns the same comparison into a failed check.
    result = cli("diag", "--kv-path", qwen3_artifact, "--n", "3", "--max-logit-diff", "-1")
    assert result.exit_code == 1 and "exceeds" in result.stderr


def test_continue_matches_a_full_prefill(cli, qwen3_artifact, qwen3_dir):
    from kvcdn_core import runtime
    from kvcdn_core.exactness import against_prefill

    result = cli("continue", "--kv-path", qwen3_artifact, "--question", " And then?", "--n", "12", "--format", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    session = runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")
    context_ids = artifact.read_token_ids(qwen3_artifact)
    question_ids = session.adapter.encode_continuation(session.tokenizer, " And then?")
    expected, _ = against_prefill.reference(session, context_ids, question_ids, 12)
    assert data["token_ids"] == expected
    assert data["reused_tokens"] == len(context_ids)


def test_inspect_human_form(cli, qwen3_artifact):
    result = cli("inspect", qwen3_artifact, "--check")
    assert result.exit_code == 0
    assert "Qwen3ForCausalLM (family qwen)" in result.stdout
    assert "2 full_attention" in result.stdout
    assert "OK, every tensor matches its blake3" in result.stdout


def test_input_errors_exit_2_with_one_line(cli, qwen3_dir, tmp_path):
    cases = [
        (("generate", "--model", qwen3_dir, "--context-file", tmp_path / "missing.txt"), "does not exist"),
        (("generate", "--model", tmp_path / "nomodel", "--context-file", tmp_path / "x"), "does not exist"),
        (("verify", "--model", qwen3_dir), "pass --kv-path"),
        (("inspect", tmp_path / "nothing.kv"), "does not exist"),
        (("verify", "--n", "0", "--kv-path", "x.kv"), "Invalid value"),
    ]
    (tmp_path / "empty.txt").write_text("  \n")
    cases.append((("generate", "--model", qwen3_dir, "--context-file", tmp_path / "empty.txt"), "is empty"))
    for args, message in cases:
        result = cli(*args)
        assert result.exit_code == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_unclaimed_architecture_gets_a_clear_error(cli, qwen3_dir, tmp_path, context_file):
    model = tmp_path / "weird"
    shutil.copytree(qwen3_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = cli("generate", "--model", model, "--context-file", context_file)
    assert result.exit_code == 2
    assert "no installed kvcdn model plugin serves architecture 'MadeUpForCausalLM'" in result.stderr
    assert "pip install 'kvcdn[" in result.stderr


def test_unreachable_hub_is_explained(cli, context_file, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("generate", "--model", "no-such-org/no-such-model", "--context-file", context_file)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert (
        "model 'no-such-org/no-such-model' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
        in result.stderr
    )
    assert "local model directory" in result.stderr


def test_unreachable_hub_says_offline_not_a_library_error(context_file, tmp_path):
    """Online mode with no route to the hub (a laptop on a plane); a subprocess: the hub's URL is read at import."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))  # nothing listens on port 9
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcdn_core",
            "generate",
            "--model",
            "no-such-org/no-such-model",
            "--context-file",
            str(context_file),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    assert "the Hugging Face hub is unreachable (offline?)" in result.stderr
    assert "ConnectError" not in result.stderr and "Errno" not in result.stderr


def test_other_weights_with_the_same_config_are_refused(cli, qwen3_artifact, tmp_path):
    """A fine-tune keeps its base config and tokenizer; its cache still differs."""
    from kvcdn_model_qwen import QwenAdapter

    from kvcdn_core.model.tiny import build_tiny_model

    other = build_tiny_model(QwenAdapter, "Qwen3ForCausalLM", tmp_path / "other-seed", seed=7)
    assert artifact.read_manifest(qwen3_artifact)["model"]["weights_sha256"]
    result = cli("continue", "--kv-path", qwen3_artifact, "--model", other, "--n", "2")
    assert result.exit_code == 2
    assert "weights differs" in result.stderr and "architecture" not in result.stderr.split(":")[-1]


def test_output_path_problems_are_reported_before_any_model_work(cli, qwen3_dir, context_file, tmp_path):
    (tmp_path / "adir.kv").mkdir()
    result = cli("generate", "--model", qwen3_dir, "--context-file", context_file, "--output", tmp_path / "adir.kv")
    assert result.exit_code == 2
    assert f"cannot write '{tmp_path / 'adir.kv'}': it is a directory" in result.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_usage_errors_are_one_line(run_kvcdn):
    for args, message in (
        (["verify", "--n", "0"], "Invalid value for '--n'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["generate"], "Missing option '--context-file'"),
    ):
        code, _, err = run_kvcdn(*args)
        assert code == 2
        assert err.strip().splitlines() == [err.strip()] and err.startswith("error: ") and message in err


def test_continue_dir_skips_a_damaged_best_artifact(cli, qwen3_artifact, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(qwen3_artifact, cache / "a-damaged.kv")
    shutil.copy(qwen3_artifact, cache / "b-good.kv")
    data = bytearray((cache / "a-damaged.kv").read_bytes())
    data[len(data) // 2] ^= 0x40
    (cache / "a-damaged.kv").write_bytes(bytes(data))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(artifact.read_manifest(qwen3_artifact)["context"] + " What next?")
    result = cli("continue", "--dir", cache, "--prompt-file", prompt, "--n", "4", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert "skipping" in result.stderr and "a-damaged.kv" in result.stderr
    assert json.loads(result.stdout)["reused_tokens"] > 0


def test_failed_generate_creates_nothing(cli, tmp_path):
    """An empty context (/dev/null) fails before anything, including the output's directory, exists."""
    target = tmp_path / "new" / "deeper" / "out.kv"
    result = cli("generate", "--context-file", "/dev/null", "--output", target)
    assert result.exit_code == 2 and "is empty" in result.stderr
    assert not (tmp_path / "new").exists()
    bad_model = cli("generate", "--model", tmp_path / "missing-model", "--context-file", __file__, "-o", target)
    assert bad_model.exit_code == 2 and not (tmp_path / "new").exists()


def test_verify_says_what_it_is_doing(cli, qwen3_artifact, monkeypatch):
    from kvcdn_core.cli.commands import verify

    monkeypatch.setattr(verify, "on_terminal", lambda: True)
    result = cli("verify", "--kv-path", qwen3_artifact, "--n", "4")
    assert result.exit_code == 0, result.stderr
    assert f"loading the model of {qwen3_artifact} ..." in result.stderr
    assert "decoding 4 tokens twice: from the artifact, and after a full prefill" in result.stderr
    quiet = cli("verify", "--kv-path", qwen3_artifact, "--n", "4", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_verify_help_shows_the_default_question_on_one_line(cli):
    from kvcdn_core.model.defaults import DEFAULT_QUESTION

    text = cli("verify", "--help").stdout
    assert "Q: Summarize" in text and "\nA:" not in text and repr(DEFAULT_QUESTION)[:12] in text


def test_a_local_model_path_makes_a_plain_file_name():
    from kvcdn_core.paths import model_slug

    assert model_slug("Qwen/Qwen3-0.6B") == "Qwen_Qwen3-0.6B"
    assert model_slug("./tiny-qwen3") == "tiny-qwen3"
    assert model_slug("/models/tiny-qwen3/") == "tiny-qwen3"


def test_serve_refuses_a_missing_local_model(tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    result = subprocess.run(
        [sys.executable, "-m", "kvcdn_core", "serve", "--port", "0", "--models", "./missing"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=budget(60),
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --models: model directory './missing' does not exist"


def test_continue_parses_the_manifest_once(cli, qwen3_artifact, monkeypatch):
    """`continue --kv-path` opens, checks and loads one artifact: its manifest is typed one time
    (it was three: open_artifact, check_model and load_cache each parsed the header's dict)."""
    from kvcdn_core.artifact.manifest import Manifest

    calls = []
    parse = Manifest.from_dict.__func__

    def counting(cls, data):
        calls.append(data.get("token_count"))
        return parse(cls, data)

    monkeypatch.setattr(Manifest, "from_dict", classmethod(counting))
    result = cli("continue", "--kv-path", qwen3_artifact, "--n", "2", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert len(calls) == 1, calls


def test_quant_and_pack_parse_the_input_manifest_once(cli, qwen3_artifact, tmp_path, monkeypatch):
    """`quant` and packing into a store read one header's manifest typed, once (quant parsed it twice:
    quantize_cache typed the dict again; packing indexed it by keys and typed it again for the record)."""
    from kvcdn_core import artifact
    from kvcdn_core.artifact.manifest import Manifest, manifest_of
    from kvcdn_core.store import pack

    calls = []
    parse = Manifest.from_dict.__func__

    def counting(cls, data):
        calls.append(bool(data.get("quantization")))
        return parse(cls, data)

    monkeypatch.setattr(Manifest, "from_dict", classmethod(counting))
    out = tmp_path / "q.kv"
    result = cli("quant", "--kv-path", qwen3_artifact, "--output", out)
    assert result.exit_code == 0, result.stderr
    assert calls.count(False) == 1, calls  # the unquantized input
    calls.clear()
    header = artifact.read_header(qwen3_artifact)
    names = pack.chunked_names(header)
    root = pack.root_of(manifest_of(header))
    assert names and root and len(calls) == 1, calls


def test_continue_takes_the_prompt_as_text_or_file(cli, tmp_path):
    """continue's prompt is --prompt or --prompt-file, as search's: exactly one, not empty."""
    missing = cli("continue", "--dir", tmp_path)
    assert missing.exit_code == 2 and "--dir needs --prompt or --prompt-file" in missing.stderr
    both = cli("continue", "--dir", tmp_path, "--prompt", "x", "--prompt-file", tmp_path / "p.txt")
    assert both.exit_code == 2 and "pass exactly one of --prompt and --prompt-file" in both.stderr
    empty = cli("continue", "--dir", tmp_path, "--prompt", "")
    assert empty.exit_code == 2 and "the prompt is empty" in empty.stderr
