"""The ``linear_and_full_attention`` layer kind: the strict validator checks its roles, and a reader
that does not know the kind (an older kvcdn) refuses the file with one clear line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import LayerEntry, Manifest
from kvcdn_core.errors import ArtifactError

KIND = artifact.LINEAR_AND_FULL_ATTENTION
#: The kinds of every reader before this kind was added.
OLD_KINDS = tuple(k for k in artifact.LAYER_KINDS if k != KIND)
SHAPES = {
    "key": (1, 2, 40, 16),
    "value": (1, 2, 40, 16),
    "conv_state": (1, 160, 4),
    "recurrent_state": (1, 8, 16, 16),
}


def write(path, roles=SHAPES, **fields):
    """An artifact of one full-attention layer and one ``linear_and_full_attention`` layer."""
    gen = torch.Generator().manual_seed(0)
    tensors = {artifact.TOKEN_IDS: torch.arange(40)}
    layers = [{"index": 0, "kind": artifact.FULL_ATTENTION, "tensors": {}}]
    for role in ("key", "value"):
        tensors[f"layers.0.{role}"] = torch.randn(SHAPES[role], generator=gen)
        layers[0]["tensors"][role] = f"layers.0.{role}"
    layers.append({"index": 1, "kind": KIND, "conv_kernel": 4, **fields, "tensors": {}})
    for role, shape in roles.items():
        tensors[f"layers.1.{role}"] = torch.randn(shape, generator=gen)
        layers[1]["tensors"][role] = f"layers.1.{role}"
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-12-01T07:00:00+00:00",
        "model": {"id": "tiny", "architecture": "FalconH1ForCausalLM"},
        "compute_dtype": "float32",
        "layers": layers,
        "quantization": None,
    }
    return artifact.write_artifact(path, manifest, tensors)


def test_a_valid_layer_reads_and_is_whole_prefix(tmp_path):
    header = artifact.read_header(write(tmp_path / "a.kv"))
    assert header.manifest["layers"][1]["kind"] == KIND
    assert Manifest.from_dict(header.manifest).reuse == "whole_prefix"
    assert Manifest.from_dict(header.manifest).layers[1].keeps_state
    assert artifact.check_hashes(header) == []


def test_several_states_are_roles_too(tmp_path):
    roles = dict(SHAPES, **{"conv_state.1": (1, 160, 4), "recurrent_state.1": (1, 8, 16, 16)})
    assert artifact.read_header(write(tmp_path / "a.kv", roles)).manifest["layers"][1]["tensors"].keys() == roles.keys()


@pytest.mark.parametrize(
    "roles,fields",
    [
        ({k: v for k, v in SHAPES.items() if k != "value"}, {}),  # no values
        ({"key": SHAPES["key"], "value": SHAPES["value"]}, {}),  # no state
        (dict(SHAPES, extra=(1, 2)), {}),  # a role the kind does not have
        (dict(SHAPES, **{"conv_state.0": (1, 2)}), {}),  # state 0 has no suffix
        (SHAPES, {"conv_kernel": "4"}),
        (SHAPES, {"conv_kernel": -1}),
    ],
)
def test_the_validator_refuses_a_malformed_layer(tmp_path, roles, fields):
    path = write(tmp_path / "bad.kv", roles, **fields)
    with pytest.raises(ArtifactError, match=f"layer 1 \\('{KIND}'\\) needs key, value, state tensors"):
        artifact.read_header(path)


def test_a_reader_without_the_kind_refuses_it_clearly(tmp_path, monkeypatch):
    """An older kvcdn (its kind list lacks this one) refuses the file before reading any tensor."""
    path = write(tmp_path / "new.kv")
    monkeypatch.setattr(artifact, "LAYER_KINDS", OLD_KINDS)
    with pytest.raises(ArtifactError) as err:
        artifact.read_header(path)
    message = str(err.value)
    assert f"layer 1 has kind '{KIND}', which this kvcdn does not know" in message
    assert "upgrade kvcdn" in message and "\n" not in message


def test_the_cli_refuses_an_unknown_kind_in_one_line(tmp_path):
    """What a user of an older kvcdn sees: one line, exit status 2, no traceback."""
    path = write(tmp_path / "new.kv")
    code = (
        "import sys\nfrom kvcdn_core import artifact\n"
        f"artifact.LAYER_KINDS = {OLD_KINDS!r}\n"
        "from kvcdn_core.cli.app import main\nsys.exit(main(['inspect', sys.argv[1]]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "which this kvcdn does not know" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""


def test_an_unprintable_unknown_kind_is_not_echoed(tmp_path):
    path = write(tmp_path / "a.kv")
    header = artifact.read_header(path)
    manifest = dict(
        header.manifest, layers=[header.manifest["layers"][0], dict(header.manifest["layers"][1], kind="x\x1b[2J")]
    )
    with pytest.raises(ArtifactError, match="unknown kind") as err:
        artifact._check_manifest_types(dataclasses.replace(header, manifest=manifest))
    assert "\x1b" not in str(err.value).replace("\\x1b", "")


def test_validate_reports_the_kind_as_a_feature():
    """`kvcdn validate --format json` and the README table say what was proven: this kind included."""
    import transformers

    from kvcdn_core.exactness.architecture import exercised

    cfg = transformers.FalconH1Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    proven = exercised(cfg, [LayerEntry(0, KIND), LayerEntry(1, KIND)])
    assert KIND in proven["features"] and proven["layer_kinds"] == [KIND]
