"""The .kv format: self-describing, validated on read, written atomically."""

from __future__ import annotations

import json
import os
import struct

import pytest

from kvcdn_core import artifact
from kvcdn_core.errors import ArtifactError, KvcdnError


def _write(path, n_tokens=5, **manifest_extra):
    import torch

    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00+00:00",
        "model": {"id": "m", "architecture": "X"},
        "compute_dtype": "float32",
        "context": "abc",
        "quantization": None,
        "layers": [
            {"index": 0, "kind": "full_attention", "tensors": {"key": "layers.0.key", "value": "layers.0.value"}}
        ],
        **manifest_extra,
    }
    g = torch.Generator().manual_seed(0)
    tensors = {
        "layers.0.key": torch.randn(1, 2, n_tokens, 4, generator=g),
        "layers.0.value": torch.randn(1, 2, n_tokens, 4, generator=g),
        "token_ids": torch.arange(n_tokens, dtype=torch.long) + 100,
    }
    artifact.write_artifact(path, manifest, tensors)
    return tensors


def test_header_and_token_ids_read_without_tensors(tmp_path):
    path = tmp_path / "a.kv"
    _write(path)
    header = artifact.read_header(path)
    assert header.manifest["token_count"] == 5
    assert artifact.read_token_ids(path) == [100, 101, 102, 103, 104]
    assert set(header.manifest["tensors"]) == {"layers.0.key", "layers.0.value", "token_ids"}
    assert header.format_version == 2 and header.digest == "blake3"
    assert all(len(t["blake3"]) == 64 and "sha256" not in t for t in header.manifest["tensors"].values())
    assert artifact.check_hashes(header) == []


def test_tensors_round_trip_bitwise_and_interoperate_with_safetensors(tmp_path):
    import torch
    from safetensors import safe_open

    path = tmp_path / "a.kv"
    written = _write(path)
    loaded = artifact.load_tensors(artifact.read_header(path))
    for name, tensor in written.items():
        assert torch.equal(loaded[name], tensor)
    with safe_open(str(path), "pt") as fh:  # a plain safetensors reader sees the same file
        assert fh.metadata()[artifact.META_FORMAT] == artifact.FORMAT_NAME
        assert torch.equal(fh.get_tensor("layers.0.key"), written["layers.0.key"])


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "a.kv"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(ArtifactError, match="truncated"):
        artifact.read_header(path)
    path.write_bytes(data[:20])
    with pytest.raises(ArtifactError, match="truncated"):
        artifact.read_header(path)


def test_corrupted_tensor_bytes_fail_the_hash_check(tmp_path):
    path = tmp_path / "a.kv"
    _write(path)
    data = bytearray(path.read_bytes())
    data[-50] ^= 0xFF
    path.write_bytes(bytes(data))
    header = artifact.read_header(path)  # structure is intact
    assert artifact.check_hashes(header)
    with pytest.raises(ArtifactError, match="blake3 mismatch"):
        artifact.load_tensors(header)


def test_corrupted_header_and_foreign_files_are_refused(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "a.kv"
    _write(path)
    data = bytearray(path.read_bytes())
    data[8] = ord("#")  # the opening brace of the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="not valid JSON"):
        artifact.read_header(path)

    foreign = tmp_path / "model.kv"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(ArtifactError, match="without a kvcdn manifest"):
        artifact.read_header(foreign)

    text = tmp_path / "notes.kv"
    text.write_text("hello world, this is not an artifact at all")
    with pytest.raises(ArtifactError, match="not a kvcdn artifact"):
        artifact.read_header(text)


def _rewrite_metadata(path, **changes):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].update(changes)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_newer_format_version_and_manifest_mismatch_are_refused(tmp_path):
    path = tmp_path / "a.kv"
    _write(path)
    _rewrite_metadata(path, **{artifact.META_VERSION: "3"})
    with pytest.raises(ArtifactError, match="format version 3 is newer than this kvcdn reads"):
        artifact.read_header(path)

    _write(path)
    manifest = artifact.read_manifest(path)
    manifest["tensors"]["layers.0.key"]["shape"] = [1, 2, 6, 4]
    _rewrite_metadata(path, **{artifact.META_MANIFEST: json.dumps(manifest)})
    with pytest.raises(ArtifactError, match="the manifest says"):
        artifact.read_header(path)


def test_write_is_atomic_and_leaves_nothing_on_error(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "a.kv"
    _write(path)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(KvcdnError, match="cannot write .*a.kv': disk full"):
        _write(path, n_tokens=7)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["a.kv"]


def test_kv_suffix_is_appended_with_a_warning(recwarn):
    from kvcdn_core import KvcdnWarning
    from kvcdn_core.paths import ensure_kv_suffix

    assert str(ensure_kv_suffix("out/ctx")) == "out/ctx.kv"
    assert [(w.category, str(w.message)) for w in recwarn] == [
        (KvcdnWarning, "KV artifact path 'out/ctx' does not end with '.kv'; appending '.kv'")
    ]
    recwarn.clear()
    assert str(ensure_kv_suffix("a.kv")) == "a.kv"
    assert len(recwarn) == 0


def test_artifacts_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "a.kv"
        _write(path)
    finally:
        os.umask(old)
    assert (path.stat().st_mode & 0o777) == 0o644


@pytest.mark.parametrize(
    "change",
    [
        {"layers": 5},
        {"token_count": "abc"},
        {"model": []},
        {"layers": [{"index": 0, "tensors": {}}]},
        {"tensors": {"layers.0.key": {"dtype": "F32"}}},
        {"tensors": {"layers.0.key": {"dtype": "F32", "shape": ["1", 2]}}},
    ],
)
def test_malformed_manifests_are_refused_as_corrupted(tmp_path, change):
    path = tmp_path / "a.kv"
    _write(path)
    manifest = artifact.read_manifest(path)
    manifest.update(change)
    _rewrite_metadata(path, **{artifact.META_MANIFEST: json.dumps(manifest)})
    with pytest.raises(ArtifactError, match="corrupted"):
        artifact.read_header(path)


def test_metadata_that_is_not_a_map_is_refused(tmp_path):
    path = tmp_path / "a.kv"
    _write(path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = [1]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(ArtifactError, match="not a kvcdn artifact"):
        artifact.read_header(path)
