"""Checking an artifact's digests costs bounded memory, whatever the file's size (issue 26, item 1).

The hosted server checks every upload at confirm with ``check_file``; it used to read the whole file
into one buffer (a 1 GiB upload took the server from 92 to 1,120 MB). The check now streams the file
through two small buffers. Peak memory is measured in a child process (its RSS high-water mark), on
a 256 MiB artifact, against a budget of 64 MiB above what the child held before the check.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcdn_core import artifact
from kvcdn_core.artifact import stream_check
from kvcdn_core.errors import ArtifactError
from kvcdn_core.testing.large_artifact import write_large_kv

#: what one check may add to a process's peak RSS
BUDGET = 64 << 20
SIZE = 256 << 20

#: Runs ``CALL`` in a fresh interpreter after the imports and the header read, and prints the growth
#: of the RSS high-water mark (Linux reports ``ru_maxrss`` in KiB) and what the call said.
CHILD = """
import json, resource, sys
from kvcdn_core import artifact
from kvcdn_core.artifact import stream_check
from kvcdn_core.cli.app import main
path = sys.argv[1]
artifact.read_header(path)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    result = {CALL}
except SystemExit as done:
    result = done.code
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew": (after - before) * 1024, "result": repr(result)}))
"""


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    path = tmp_path_factory.mktemp("large") / "large.kv"
    write_large_kv(path, SIZE, seed=1)
    return path


def _peak_growth(call: str, path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD.replace("{CALL}", call), str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's unit")
def test_check_file_of_a_large_artifact_stays_within_the_budget(large):
    assert large.stat().st_size >= SIZE
    got = _peak_growth("artifact.check_file(path).token_count", large)
    assert got["result"] == "16"
    assert got["grew"] <= BUDGET, f"check_file grew the peak RSS by {got['grew'] >> 20} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's unit")
def test_inspect_check_of_a_large_artifact_stays_within_the_budget(large):
    got = _peak_growth('main(["inspect", "--check", "--format", "json", path])', large)
    assert got["result"] == "0"
    assert got["grew"] <= BUDGET, f"inspect --check grew the peak RSS by {got['grew'] >> 20} MiB"


def test_a_corrupted_large_artifact_is_refused_after_the_whole_read(tmp_path):
    path = tmp_path / "bad.kv"
    write_large_kv(path, 16 << 20, corrupt=True)
    with pytest.raises(ArtifactError, match=r"blake3 mismatch in 1 tensor\(s\), first 'layers.3.value'"):
        artifact.check_file(path)


@pytest.mark.parametrize("chunk", [5, 1000, 4096, 1 << 20])
def test_pieces_that_cut_tensors_anywhere_hash_the_same(tmp_path, monkeypatch, chunk):
    """Read pieces smaller than a tensor, or holding several: every tensor is hashed exactly, and a
    flipped byte in any tensor is found."""
    path = tmp_path / "a.kv"
    write_large_kv(path, 16 << 10, seed=3)
    monkeypatch.setattr(stream_check, "CHUNK", chunk)
    header = artifact.read_header(path)
    assert stream_check.mismatched(header) == []
    data = bytearray(path.read_bytes())
    for name, entry in header.entries.items():
        flipped = tmp_path / f"{name}.kv"
        start, end = entry["data_offsets"]
        copy = bytearray(data)
        copy[header.data_start + (start + end) // 2] ^= 0x01
        flipped.write_bytes(bytes(copy))
        assert stream_check.mismatched(artifact.read_header(flipped)) == [name]


def test_a_file_truncated_after_its_header_was_read_is_one_error(tmp_path):
    path = tmp_path / "a.kv"
    write_large_kv(path, 1 << 20)
    header = artifact.read_header(path)
    with open(path, "r+b") as fh:
        fh.truncate(header.file_size - 100)
    with pytest.raises(ArtifactError, match="truncated while reading tensor data"):
        stream_check.mismatched(header)


def test_token_ids_are_checked_a_piece_at_a_time(tmp_path):
    """A negative id in a later piece is found; pieces are whole ids."""
    import torch

    ids = torch.arange(10_000, dtype=torch.int64)
    ids[9_999] = -1
    path = artifact.write_artifact(
        tmp_path / "t.kv",
        {
            "kvcdn_version": "0.1.0",
            "created_at": "2026-01-01T00:00:00Z",
            "model": {"id": "example/m"},
            "compute_dtype": "float32",
            "layers": [],
        },
        {"token_ids": ids},
    )
    header = artifact.read_header(path)
    for piece in (8, 100, 1 << 20):
        with pytest.raises(ArtifactError, match="negative token id"):
            artifact._check_token_ids(header, piece)
