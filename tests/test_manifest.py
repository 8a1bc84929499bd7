"""The typed manifest reads what the writer wrote, and decides reuse like the format does."""

from __future__ import annotations

from kvcdn_core import artifact
from kvcdn_core.manifest import ANY_PREFIX, WHOLE_PREFIX, LayerEntry, Manifest


def _manifest(**changes):
    base = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00+00:00",
        "model": {
            "id": "m",
            "revision": None,
            "family": "qwen",
            "architecture": "Qwen3ForCausalLM",
            "config_sha256": "c",
            "tokenizer_sha256": "t",
            "weights_sha256": "w",
        },
        "compute_dtype": "float32",
        "token_count": 7,
        "quantization": None,
        "layers": [
            {"index": 0, "kind": artifact.FULL_ATTENTION, "tensors": {"key": "l0.key", "value": "l0.value"}},
            {"index": 1, "kind": artifact.SLIDING_WINDOW, "window": 16, "tensors": {"key": "l1.key"}},
        ],
    }
    return {**base, **changes}


def test_fields_are_typed():
    m = Manifest.from_dict(_manifest())
    assert m.model.architecture == "Qwen3ForCausalLM" and m.model.weights_sha256 == "w"
    assert m.token_count == 7 and m.compute_dtype == "float32" and m.scheme is None
    assert m.layers[1] == LayerEntry(1, artifact.SLIDING_WINDOW, {"key": "l1.key"}, m.raw["layers"][1])
    assert m.layers[1].raw["window"] == 16 and m.layer_dicts == m.raw["layers"]


def test_reuse_is_the_stricter_of_declared_and_layer_kinds():
    assert Manifest.from_dict(_manifest()).reuse == WHOLE_PREFIX  # a sliding-window layer
    full = _manifest(layers=[{"index": 0, "kind": artifact.FULL_ATTENTION, "tensors": {}}])
    assert Manifest.from_dict(full).reuse == ANY_PREFIX
    assert Manifest.from_dict({**full, "reuse": WHOLE_PREFIX}).reuse == WHOLE_PREFIX


def test_quantization_block():
    m = Manifest.from_dict(_manifest(quantization={"scheme": "int8", "layers": []}))
    assert m.scheme == "int8" and m.quantization == {"scheme": "int8", "layers": []}
