"""The id `upload --to <store>` prints is the id download and delete accept, with or without `.kv`."""

from __future__ import annotations


def test_upload_download_delete_by_the_printed_id_and_by_the_name(cli, qwen3_artifact, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    uploaded = cli("upload", qwen3_artifact, "--to", store, "--name", "local1")
    assert uploaded.exit_code == 0, uploaded.stderr
    printed = uploaded.stdout.strip()
    assert printed == "local1.kv"

    by_name = cli("download", "local1", "--from", store)  # the --name given to upload
    assert by_name.exit_code == 0, by_name.stderr
    assert (tmp_path / "local1.kv").read_bytes() == qwen3_artifact.read_bytes()
    by_id = cli("download", printed, "--from", store, "--output", tmp_path / "copy.kv")  # the printed id
    assert by_id.exit_code == 0, by_id.stderr
    assert (tmp_path / "copy.kv").read_bytes() == qwen3_artifact.read_bytes()

    assert cli("delete", "local1", "--from", store, "--yes").exit_code == 0
    missing = cli("download", "local1", "--from", store, "--force")
    assert missing.exit_code == 2 and "local1.kv" in missing.stderr and missing.stderr.count("\n") == 1
