"""The ``mla_indexed`` layer kind (MLA latent + DSA indexer keys) in the strict validator, and the
refusal of a kind this kvcdn does not know (what an older kvcdn says about a newer artifact)."""

from __future__ import annotations

import pytest

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import Manifest
from kvcdn_core.errors import ArtifactError

T = 7


def _write(path, **entry_changes):
    import torch

    entry = {
        "index": 0,
        "kind": artifact.MLA_INDEXED,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "index_head_dim": 6,
        "tensors": {role: f"layers.0.{role}" for role in artifact.MLA_ROLES},
        **entry_changes,
    }
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00+00:00",
        "model": {"id": "m", "architecture": "DeepseekV32ForCausalLM"},
        "compute_dtype": "float32",
        "layers": [entry],
    }
    tensors = {
        "layers.0.latent": torch.zeros(1, 1, T, 8),
        "layers.0.rotary_key": torch.zeros(1, 1, T, 4),
        "layers.0.indexer_key": torch.zeros(1, T, 6),
        "token_ids": torch.arange(T, dtype=torch.long),
    }
    artifact.write_artifact(path, manifest, tensors)  # the writer trusts its caller; every reader checks
    return artifact.read_header(path)


def test_an_indexed_mla_layer_is_read_and_croppable(tmp_path):
    header = _write(tmp_path / "a.kv")
    assert header.manifest["layers"][0]["kind"] == artifact.MLA_INDEXED
    assert Manifest.from_dict(header.manifest).reuse == "any_prefix"


@pytest.mark.parametrize(
    "change",
    [
        {"tensors": {"latent": "layers.0.latent", "rotary_key": "layers.0.rotary_key"}},
        {"index_head_dim": None},
        {"index_head_dim": 0},
        {"kv_lora_rank": 8.0},
    ],
)
def test_an_incomplete_indexed_layer_is_refused(tmp_path, change):
    with pytest.raises(ArtifactError, match=r"corrupted: manifest layer 0 \(mla_indexed\) lacks"):
        _write(tmp_path / "a.kv", **change)


def test_a_kind_from_a_newer_kvcdn_is_refused_by_name(tmp_path):
    with pytest.raises(ArtifactError, match="layer 0 has kind 'mla_future', which this kvcdn does not know"):
        _write(tmp_path / "a.kv", kind="mla_future")
