"""One rule wherever a command writes a file: an existing output is refused (one line, exit 2, the
file untouched) unless --force replaces it."""

from __future__ import annotations

import json

import pytest

RULE = "exists; pass --force to replace it"


def refused(result, path, before: bytes) -> None:
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and f"{path.name}' {RULE}" in result.stderr, result.stderr
    assert path.read_bytes() == before, "a refused command changed the existing file"


@pytest.fixture
def occupied(tmp_path):
    """An existing file where a command is about to write."""

    def make(name: str) -> tuple:
        path = tmp_path / name
        path.write_bytes(b"precious")
        return path, b"precious"

    return make


def test_generate_output(cli, qwen3_dir, context_file, occupied):
    path, before = occupied("out.kv")
    refused(cli("generate", "--model", qwen3_dir, "--context-file", context_file, "-o", path), path, before)
    forced = cli("generate", "--model", qwen3_dir, "--context-file", context_file, "-o", path, "--force")
    assert forced.exit_code == 0, forced.stderr
    assert path.read_bytes()[:8] != before[:8]


def test_quant_output_and_its_event(cli, qwen3_artifact, tmp_path, occupied):
    source = tmp_path / "doc.kv"
    source.write_bytes(qwen3_artifact.read_bytes())
    out, before = occupied("doc.q8.kv")
    refused(cli("quant", "--kv-path", source), out, before)
    out.unlink()
    event, before = occupied("doc.q8.kv.quant-event.json")
    refused(cli("quant", "--kv-path", source), event, before)
    assert not out.exists(), "nothing is written when the event file is refused"
    assert cli("quant", "--kv-path", source, "--force").exit_code == 0
    assert json.loads(event.read_text())["output"] == str(out)


def test_plot_out(cli, tmp_path, occupied):
    csv_path = tmp_path / "bench.csv"
    csv_path.write_text("tokens,prefill_s,load_s\n128,0.2,0.05\n")
    png, before = occupied("chart.png")
    refused(cli("plot", "--csv-path", csv_path, "--output", png), png, before)
    assert "--output to choose another path" in cli("plot", "--csv-path", csv_path, "--output", png).stderr
    assert cli("plot", "--csv-path", csv_path, "--output", png, "--force").exit_code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_benchmark_output_is_checked_before_any_measuring(cli, qwen3_dir, occupied):
    csv_path, before = occupied("bench.csv")
    refused(cli("benchmark", "--model", qwen3_dir, "--lengths", "16", "--reps", "1", "-o", csv_path), csv_path, before)


def test_download_from_a_store(cli, qwen3_artifact, tmp_path, occupied, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    assert cli("upload", qwen3_artifact, "--to", store, "--name", "local1").exit_code == 0
    target, before = occupied("local1.kv")
    refused(cli("download", "local1", "--from", store), target, before)
    assert cli("download", "local1", "--from", store, "--force").exit_code == 0
    assert target.read_bytes() == qwen3_artifact.read_bytes()


def test_upload_to_a_store(cli, qwen3_artifact, tmp_path):
    store = tmp_path / "store"
    assert cli("upload", qwen3_artifact, "--to", store, "--name", "doc").exit_code == 0
    (store / "doc.kv").write_bytes(b"precious")
    again = cli("upload", qwen3_artifact, "--to", store, "--name", "doc")
    assert again.exit_code == 2 and again.stderr.count("\n") == 1
    assert f"'doc.kv' exists in {store}; pass --force to replace it" in again.stderr
    assert (store / "doc.kv").read_bytes() == b"precious"
    assert cli("upload", qwen3_artifact, "--to", store, "--name", "doc", "--force").exit_code == 0
    assert (store / "doc.kv").read_bytes() == qwen3_artifact.read_bytes()
