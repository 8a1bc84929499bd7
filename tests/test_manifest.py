"""The typed manifest reads what the writer wrote, and decides reuse like the format does."""

from __future__ import annotations

import json

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import ANY_PREFIX, WHOLE_PREFIX, LayerEntry, Manifest, reuse_of


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
    assert m.layers[1] == LayerEntry(1, artifact.SLIDING_WINDOW, {"key": "l1.key"}, window=16)
    assert m.layers[0].croppable and not m.layers[1].croppable and not m.layers[0].keeps_state


def test_layer_entries_write_back_the_json_they_were_read_from():
    entries = [
        *_manifest()["layers"],
        {"index": 2, "kind": artifact.SLIDING_WINDOW, "window": 8, "cumulative_length": 40, "tensors": {}},
        {"index": 3, "kind": artifact.MLA_LATENT, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "tensors": {"a": "b"}},
        {"index": 4, "kind": artifact.LINEAR_ATTENTION, "conv_kernel": 0, "tensors": {"conv_state": "c"}},
    ]
    for entry in entries:
        typed = LayerEntry.from_dict(entry)
        assert typed.to_dict() == entry
        assert json.dumps(typed.to_dict(), sort_keys=True) == json.dumps(entry, sort_keys=True)
    mla = LayerEntry.from_dict(entries[3])
    assert mla.family_fields == {"kv_lora_rank": 32, "qk_rope_head_dim": 8} and mla.window is None
    assert mla.with_fields(kv_lora_rank=64).family_fields == {"kv_lora_rank": 64, "qk_rope_head_dim": 8}
    assert LayerEntry.from_dict(entries[4]).keeps_state


def test_reuse_of_layer_kinds():
    assert reuse_of([LayerEntry(0, artifact.FULL_ATTENTION), LayerEntry(1, artifact.MLA_LATENT)]) == ANY_PREFIX
    assert reuse_of([LayerEntry(0, artifact.FULL_ATTENTION), LayerEntry(1, artifact.RECURRENT_STATE)]) == WHOLE_PREFIX


def test_reuse_is_the_stricter_of_declared_and_layer_kinds():
    assert Manifest.from_dict(_manifest()).reuse == WHOLE_PREFIX  # a sliding-window layer
    full = _manifest(layers=[{"index": 0, "kind": artifact.FULL_ATTENTION, "tensors": {}}])
    assert Manifest.from_dict(full).reuse == ANY_PREFIX
    assert Manifest.from_dict({**full, "reuse": WHOLE_PREFIX}).reuse == WHOLE_PREFIX


def test_quantization_block():
    m = Manifest.from_dict(_manifest(quantization={"scheme": "int8", "layers": []}))
    assert m.scheme == "int8" and m.quantization == {"scheme": "int8", "layers": []}
