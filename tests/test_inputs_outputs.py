"""Inputs are read as given, outputs are checked before the work: a path to read is never renamed
and its real problem is named; every file a command writes is checked (can it be created? is it
taken?) before any model is loaded; a Ctrl-C during a model load is reported as an interrupt; a
quantized copy that is not smaller than its input is said to be so, with the reason."""

from __future__ import annotations

import json

import pytest

from tests.support.outputs import unwritable_dir

NO_MODEL = "/nonexistent/kvcdn-model"  # loading it fails at once, with its own message


def one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert "model" not in result.stderr.lower(), "the model was loaded before the output was checked"


# -- inputs: never renamed ---------------------------------------------------------------------


def test_inspect_names_a_directory_and_does_not_append_kv(cli, tmp_path):
    (tmp_path / "adir").mkdir()
    result = cli("inspect", tmp_path / "adir")
    assert result.exit_code == 2
    assert result.stderr == f"error: '{tmp_path / 'adir'}' is a directory, not an artifact\n"


def test_inspect_reads_a_text_file_as_given(cli, tmp_path):
    text = tmp_path / "manual.txt"
    text.write_text("The lighthouse keeper kept a ledger of every ship.\n")
    result = cli("inspect", text)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert f"{text}: not a kvcdn artifact" in result.stderr
    assert "manual.txt.kv" not in result.stderr and "appending" not in result.stderr


def test_an_ignored_context_file_is_one_warning_line_before_the_error(cli, tmp_path, context_file):
    """The warning goes through core's warn: the same ``warning: ...`` line on stderr as ever."""
    text = tmp_path / "manual.kv"
    text.write_text("not an artifact\n")
    result = cli("verify", "--kv-path", text, "--context-file", context_file)
    assert result.exit_code == 2
    warning, error = result.stderr.splitlines()
    assert warning == f"warning: --context-file ignored: '{text}' exists and carries its own context"
    assert error.startswith(f"error: {text}: not a kvcdn artifact")


def test_a_missing_input_is_not_renamed_but_the_likely_one_is_suggested(cli, tmp_path, qwen3_artifact):
    (tmp_path / "manual.kv").write_bytes(qwen3_artifact.read_bytes())
    result = cli("inspect", tmp_path / "manual")
    assert result.exit_code == 2
    assert (
        result.stderr == f"error: '{tmp_path / 'manual'}' does not exist (did you mean '{tmp_path / 'manual.kv'}'?)\n"
    )


@pytest.mark.parametrize(
    "args",
    [
        ("continue", "--kv-path", "{dir}"),
        ("quant", "--kv-path", "{dir}"),
        ("verify", "--kv-path", "{dir}", "--model", NO_MODEL),
        ("diag", "--kv-path", "{dir}", "--model", NO_MODEL),
    ],
    ids=lambda a: a[0],
)
def test_every_command_names_a_directory_given_as_its_artifact(cli, tmp_path, args):
    folder = tmp_path / "adir"
    folder.mkdir()
    result = cli(*(a.format(dir=folder) for a in args))
    one_line_error(result, f"'{folder}' is a directory, not an artifact")
    assert "appending" not in result.stderr


def test_quant_input_is_read_as_given(cli, tmp_path, qwen3_artifact):
    source = tmp_path / "doc.bin"  # an artifact under another name is still read, not renamed
    source.write_bytes(qwen3_artifact.read_bytes())
    result = cli("quant", "--kv-path", source, "--output", tmp_path / "doc.q8.kv", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert "appending" not in result.stderr and json.loads(result.stdout)["input"] == str(source)


def test_verify_does_not_read_or_replace_an_artifact_under_a_name_it_was_not_given(
    cli, tmp_path, qwen3_artifact, context_file
):
    existing = tmp_path / "manual.kv"
    existing.write_bytes(qwen3_artifact.read_bytes())
    result = cli("verify", "--kv-path", tmp_path / "manual", "--context-file", context_file, "--model", NO_MODEL)
    assert result.exit_code == 2  # the appended .kv is warned about (an output name), then refused
    assert result.stderr.splitlines()[-1].startswith(f"error: '{existing}' exists: pass --kv-path '{existing}'")
    assert existing.read_bytes() == qwen3_artifact.read_bytes()


# -- outputs: checked before any model work ------------------------------------------------------


@pytest.fixture
def blocked(tmp_path):
    """An output path in a directory that refuses new files."""
    return unwritable_dir(tmp_path) / "out.kv"


def test_generate(cli, context_file, blocked):
    result = cli("generate", "--model", NO_MODEL, "--context-file", context_file, "--output", blocked)
    one_line_error(result, f"cannot write '{blocked}'")


def test_generate_into_a_path_under_a_file(cli, context_file, tmp_path):
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "out.kv"
    result = cli("generate", "--model", NO_MODEL, "--context-file", context_file, "--output", target)
    one_line_error(result, f"cannot write '{target}'", "is not a directory")


def test_quant_from_a_context(cli, context_file, blocked):
    result = cli("quant", "--context-file", context_file, "--model", NO_MODEL, "--output", blocked)
    one_line_error(result, f"cannot write '{blocked}'")


def test_quant_with_verify(cli, qwen3_artifact, blocked):
    result = cli("quant", "--kv-path", qwen3_artifact, "--verify", "--model", NO_MODEL, "--output", blocked)
    one_line_error(result, f"cannot write '{blocked}'")


@pytest.mark.parametrize("command", ["verify", "diag"])
def test_verify_and_diag_generating_their_artifact(cli, context_file, blocked, command):
    result = cli(command, "--model", NO_MODEL, "--context-file", context_file, "--kv-path", blocked)
    one_line_error(result, f"cannot write '{blocked}'")


def test_benchmark(cli, blocked):
    csv_path = blocked.with_name("bench.csv")
    result = cli("benchmark", "--model", NO_MODEL, "--lengths", "8", "--output", csv_path)
    one_line_error(result, f"cannot write '{csv_path}'")


def test_plot(cli, tmp_path, blocked):
    csv_path = tmp_path / "bench.csv"
    csv_path.write_text("tokens,prefill_s,load_s\n128,0.2,0.05\n")
    png = blocked.with_name("chart.png")
    result = cli("plot", "--csv-path", csv_path, "--output", png)
    one_line_error(result, f"cannot write '{png}'")


def test_the_output_check_leaves_nothing_behind(cli, context_file, tmp_path):
    result = cli("generate", "--model", NO_MODEL, "--context-file", context_file, "--output", tmp_path / "a" / "b.kv")
    assert result.exit_code == 2 and "model path" in result.stderr  # the check passed; the load failed
    assert not (tmp_path / "a").exists(), "the check made a directory"
    assert not any(p.name.startswith(".kvcdn-probe-") for p in tmp_path.rglob("*")), "the probe file stayed"


# -- an interrupt is reported as one -------------------------------------------------------------


def _wrapped_interrupt(*_args, **_kwargs):
    """What transformers' lazy import does with a Ctrl-C that lands inside it."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise ModuleNotFoundError("Could not import module 'Qwen3ForCausalLM'")  # noqa: B904 - as the library does


def test_an_interrupt_wrapped_by_the_model_loader_is_reraised(qwen3_dir, monkeypatch):
    from kvcdn_model_qwen import QwenAdapter

    from kvcdn_core import runtime

    monkeypatch.setattr(QwenAdapter, "load", _wrapped_interrupt)
    with pytest.raises(KeyboardInterrupt):
        runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")


def test_generate_reports_an_interrupt_during_the_load_as_one(cli, qwen3_dir, context_file, tmp_path, monkeypatch):
    from kvcdn_model_qwen import QwenAdapter

    monkeypatch.setattr(QwenAdapter, "load", _wrapped_interrupt)
    result = cli("generate", "--model", qwen3_dir, "--context-file", context_file, "--output", tmp_path / "o.kv")
    assert result.exit_code == 130 and result.stderr == "error: interrupted\n", result.stderr


def test_an_interrupt_found_behind_a_cause_or_a_context():
    from kvcdn_core.errors import interruption

    ctrl_c = KeyboardInterrupt()
    inner = ImportError("x")
    inner.__context__ = ctrl_c
    outer = RuntimeError("y")
    outer.__cause__ = inner
    assert interruption(outer) is ctrl_c
    assert interruption(RuntimeError("plain")) is None


# -- a quantized copy that is not smaller ------------------------------------------------------


def test_quant_warns_when_the_residual_window_covers_the_document(cli, qwen3_artifact, tmp_path):
    """The default window is 128 tokens: a short document (43 tokens in the report) is not quantized."""
    out = tmp_path / "q.kv"
    result = cli("quant", "--kv-path", qwen3_artifact, "--scheme", "int4", "--residual", "100000", "--output", out)
    assert result.exit_code == 0, result.stderr
    event = json.loads((tmp_path / "q.kv.quant-event.json").read_text())
    assert event["quantized_bytes"] >= event["original_bytes"]
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "is not smaller than its input" in warning[0], result.stderr
    assert f"the residual window (100000 tokens) covers all {event['tokens']} tokens, so nothing" in warning[0]


def test_quant_that_shrinks_the_file_does_not_warn(cli, qwen3_artifact, tmp_path):
    result = cli("quant", "--kv-path", qwen3_artifact, "--scheme", "int4", "--residual", "0", "-o", tmp_path / "q.kv")
    assert result.exit_code == 0, result.stderr
    assert "warning" not in result.stderr
