"""`.kv` files built byte by byte (no torch): a valid one, and the hostile variants of issue 13.

Shared by the parser's tests (tests/test_artifact_hostile.py, tests/test_artifact_fuzz.py) and the
server's abuse tests, so every reader is tried with the same inputs.
"""

from __future__ import annotations

import copy
import json
import struct
from dataclasses import dataclass, field

from kvcdn_core import artifact
from kvcdn_core.artifact import digests

#: how many context tokens the valid artifact holds; its tensors are tiny
TOKENS = 4
#: the digest algorithm of the format version written
DIGEST = digests.BY_FORMAT_VERSION[artifact.FORMAT_VERSION]


@dataclass
class Parts:
    """A `.kv` file taken apart: the header entries, its metadata, the manifest and the data region."""

    entries: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    data: bytes = b""

    def copy(self) -> Parts:
        return copy.deepcopy(self)

    def to_bytes(self, manifest_text: str | None = None, header_text: str | None = None) -> bytes:
        """The file; ``manifest_text`` / ``header_text`` replace the serialized JSON as given."""
        meta = dict(self.metadata)
        meta[artifact.META_MANIFEST] = (
            manifest_text if manifest_text is not None else json.dumps(self.manifest, sort_keys=True)
        )
        if header_text is None:
            header_text = json.dumps({"__metadata__": meta, **self.entries})
        return frame(header_text.encode("utf-8", "surrogatepass"), self.data)


def frame(header: bytes, data: bytes) -> bytes:
    """The safetensors framing: 8-byte little-endian length, the header padded to 8, the data."""
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def valid_parts(model_id: str = "example/tiny", tokens: int = TOKENS) -> Parts:
    """A complete, valid artifact: one full-attention layer (F32 keys and values) and token ids."""
    tensors = {
        "layers.0.key": ("F32", [1, 1, tokens, 2], struct.pack(f"<{2 * tokens}f", *range(2 * tokens))),
        "layers.0.value": ("F32", [1, 1, tokens, 2], struct.pack(f"<{2 * tokens}f", *range(-2 * tokens, 0))),
        artifact.TOKEN_IDS: ("I64", [tokens], struct.pack(f"<{tokens}q", *range(100, 100 + tokens))),
    }
    parts = Parts(
        metadata={artifact.META_FORMAT: artifact.FORMAT_NAME, artifact.META_VERSION: str(artifact.FORMAT_VERSION)}
    )
    table, offset, data = {}, 0, bytearray()
    for name, (dtype, shape, raw) in tensors.items():
        parts.entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        table[name] = {"dtype": dtype, "shape": shape, DIGEST: digests.hexdigest(DIGEST, raw)}
        offset += len(raw)
        data += raw
    parts.data = bytes(data)
    parts.manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00+00:00",
        "model": {"id": model_id, "architecture": "Qwen3ForCausalLM", "family": "qwen"},
        "compute_dtype": "float32",
        "token_count": tokens,
        "context": "abcd",
        "reuse": "any_prefix",
        "quantization": None,
        "layers": [
            {"index": 0, "kind": "full_attention", "tensors": {"key": "layers.0.key", "value": "layers.0.value"}}
        ],
        "tensors": table,
    }
    return parts


def parse(data: bytes) -> Parts:
    """A `.kv` file's bytes taken apart (the inverse of :meth:`Parts.to_bytes`)."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    meta = header.pop("__metadata__")
    manifest = json.loads(meta.pop(artifact.META_MANIFEST))
    return Parts(entries=header, metadata=meta, manifest=manifest, data=data[8 + size :])


def as_format_1(data: bytes) -> bytes:
    """A `.kv` file as kvcdn wrote it before format version 2: the same tensors, SHA-256 digests."""
    parts = parse(data)
    parts.metadata[artifact.META_VERSION] = "1"
    for name, spec in parts.manifest["tensors"].items():
        start, end = parts.entries[name]["data_offsets"]
        del spec[DIGEST]
        spec["sha256"] = digests.hexdigest("sha256", parts.data[start:end])
    return parts.to_bytes()


def valid_bytes(**kwargs) -> bytes:
    return valid_parts(**kwargs).to_bytes()


def _changed(change) -> bytes:
    parts = valid_parts()
    change(parts)
    return parts.to_bytes()


def _set(obj: dict, key: str, value):
    obj[key] = value


#: a manifest label holding a character that draws nothing or reorders text, as listings show it
LABEL_CASES = {
    f"label_with_u{ord(ch):04x}": (lambda ch=ch, where=where: _changed(lambda p: _set(*where(p), f"x{ch}y")))
    for ch, where in [
        ("\u061c", lambda p: (p.manifest["model"], "id")),  # Arabic letter mark
        ("\u2028", lambda p: (p.manifest["model"], "architecture")),  # line separator
        ("\ue000", lambda p: (p.manifest["model"], "family")),  # private use
        ("\u180e", lambda p: (p.manifest, "kvcdn_version")),  # Mongolian vowel separator
        ("\u2060", lambda p: (p.manifest["model"], "id")),  # word joiner
        ("\u3164", lambda p: (p.manifest["model"], "id")),  # Hangul filler
    ]
}


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _key_entry(parts: Parts) -> dict:
    return parts.entries["layers.0.key"]


def _both_shapes(parts: Parts, shape) -> None:
    _key_entry(parts)["shape"] = shape
    parts.manifest["tensors"]["layers.0.key"]["shape"] = shape


def _overlap(parts: Parts) -> None:
    # value reuses key's bytes; token ids follow; the data region shrinks to match
    key, value, ids = (parts.entries[n] for n in ("layers.0.key", "layers.0.value", artifact.TOKEN_IDS))
    size = key["data_offsets"][1]
    value["data_offsets"] = [0, size]
    ids_len = ids["data_offsets"][1] - ids["data_offsets"][0]
    ids["data_offsets"] = [size, size + ids_len]
    parts.data = parts.data[:size] + parts.data[-ids_len:]


def _reversed(parts: Parts) -> None:
    start, end = _key_entry(parts)["data_offsets"]
    _key_entry(parts)["data_offsets"] = [end, start]


def _gap(parts: Parts) -> None:
    for name in ("layers.0.value", artifact.TOKEN_IDS):
        start, end = parts.entries[name]["data_offsets"]
        parts.entries[name]["data_offsets"] = [start + 8, end + 8]
    size = _key_entry(parts)["data_offsets"][1]
    parts.data = parts.data[:size] + bytes(8) + parts.data[size:]


def _extra_tensor(parts: Parts) -> None:
    end = len(parts.data)
    parts.entries["smuggled"] = {"dtype": "U8", "shape": [4], "data_offsets": [end, end + 4]}
    parts.data += b"evil"


def _header_text(parts: Parts) -> str:
    meta = dict(parts.metadata, **{artifact.META_MANIFEST: json.dumps(parts.manifest)})
    return json.dumps({"__metadata__": meta, **parts.entries})


def _padding(size: int) -> bytes:
    """``size`` bytes of ``{}`` padding in ``__metadata__`` (issue 13: 20 MiB cost readers 500 MiB)."""
    parts = valid_parts()
    padding = '"padding": [' + "{}," * (size // 3) + "{}], "
    text = _header_text(parts).replace('"__metadata__": {', '"__metadata__": {' + padding, 1)
    return frame(text.encode(), parts.data)


def _header_with(extra: str) -> bytes:
    parts = valid_parts()
    return frame((_header_text(parts)[:-1] + ", " + extra + "}").encode(), parts.data)


#: name → bytes of a file every reader must refuse with ArtifactError (HTTP 422 on the server)
HOSTILE: dict[str, callable] = {
    "format_version_list": lambda: _changed(lambda p: _set(p.metadata, artifact.META_VERSION, [1])),
    "format_version_int": lambda: _changed(lambda p: _set(p.metadata, artifact.META_VERSION, 1)),
    "format_version_float": lambda: _changed(lambda p: _set(p.metadata, artifact.META_VERSION, "1.0")),
    "format_name_list": lambda: _changed(lambda p: _set(p.metadata, artifact.META_FORMAT, ["kvcdn-kv"])),
    "manifest_not_a_string": lambda: valid_parts().to_bytes(
        header_text=json.dumps(
            {
                "__metadata__": {**valid_parts().metadata, artifact.META_MANIFEST: valid_parts().manifest},
                **valid_parts().entries,
            }
        )
    ),
    "manifest_a_list": lambda: valid_parts().to_bytes(manifest_text="[1, 2]"),
    "manifest_50k_deep": lambda: valid_parts().to_bytes(manifest_text=_deep(50_000)),
    "header_50k_deep": lambda: _header_with('"x": ' + _deep(50_000)),
    "header_50k_deep_objects": lambda: _header_with('"x": ' + '{"a":' * 50_000 + "1" + "}" * 50_000),
    "metadata_20mib_padding": lambda: _padding(20 << 20),
    "metadata_padding_under_the_cap": lambda: _padding(7 << 20),
    "unknown_metadata_key": lambda: _changed(lambda p: _set(p.metadata, "note", "hi")),
    "float_offsets": lambda: _changed(
        lambda p: _set(_key_entry(p), "data_offsets", [float(o) for o in _key_entry(p)["data_offsets"]])
    ),
    "bool_offset": lambda: _changed(
        lambda p: _set(_key_entry(p), "data_offsets", [False, _key_entry(p)["data_offsets"][1]])
    ),
    "negative_offsets": lambda: _changed(lambda p: _set(_key_entry(p), "data_offsets", [-32, 0])),
    "three_offsets": lambda: _changed(
        lambda p: _set(_key_entry(p), "data_offsets", [*_key_entry(p)["data_offsets"], 0])
    ),
    "overlapping_offsets": lambda: _changed(_overlap),
    "reversed_offsets": lambda: _changed(_reversed),
    "gap_between_tensors": lambda: _changed(_gap),
    "string_shape": lambda: _changed(lambda p: _both_shapes(p, "1,1,4,2")),
    "string_dims": lambda: _changed(lambda p: _both_shapes(p, ["1", 1, 4, 2])),
    "negative_dims": lambda: _changed(lambda p: _both_shapes(p, [1, -1, 4, -2])),
    "float_dims": lambda: _changed(lambda p: _both_shapes(p, [1.0, 1, 4, 2])),
    "shape_times_itemsize_wrong": lambda: _changed(lambda p: _both_shapes(p, [1, 1, 4, 3])),
    "unknown_dtype": lambda: _changed(lambda p: _set(_key_entry(p), "dtype", "Q4_K")),
    "dtype_not_a_string": lambda: _changed(lambda p: _set(_key_entry(p), "dtype", ["F32"])),
    "tensor_missing_from_file": lambda: _changed(
        lambda p: _set(p.manifest["tensors"], "layers.1.key", p.manifest["tensors"]["layers.0.key"])
    ),
    "tensor_missing_from_manifest": lambda: _changed(_extra_tensor),
    "manifest_disagrees_on_dtype": lambda: _changed(
        lambda p: _set(p.manifest["tensors"]["layers.0.key"], "dtype", "I32")
    ),
    "token_ids_wrong_length": lambda: _changed(lambda p: _set(p.manifest, "token_count", TOKENS + 1)),
    "token_ids_float": lambda: _changed(
        lambda p: (
            _set(p.entries[artifact.TOKEN_IDS], "dtype", "F64"),
            _set(p.manifest["tensors"][artifact.TOKEN_IDS], "dtype", "F64"),
        )
    ),
    "token_count_bool": lambda: _changed(lambda p: _set(p.manifest, "token_count", True)),
    "compute_dtype_float64": lambda: _changed(lambda p: _set(p.manifest, "compute_dtype", "float64")),
    "model_id_not_a_string": lambda: _changed(lambda p: _set(p.manifest["model"], "id", ["x"])),
    "layer_names_unknown_tensor": lambda: _changed(
        lambda p: _set(p.manifest["layers"][0]["tensors"], "key", "nowhere")
    ),
    "layer_index_float": lambda: _changed(lambda p: _set(p.manifest["layers"][0], "index", 0.0)),
    "quantization_without_layers": lambda: _changed(
        lambda p: _set(p.manifest, "quantization", {"scheme": "int8", "target_dtype": "F32"})
    ),
    "quantization_parameters_a_list": lambda: _changed(
        lambda p: _set(
            p.manifest, "quantization", {"scheme": "int8", "target_dtype": "F32", "parameters": [1], "layers": []}
        )
    ),
    "quantized_tensor_without_parts": lambda: _changed(
        lambda p: _set(
            p.manifest,
            "quantization",
            {
                "scheme": "int8",
                "target_dtype": "F32",
                "layers": [{"index": 0, "tensors": {"key": {"action": "quantized", "parts": None, "shape": [1]}}}],
            },
        )
    ),
    "digest_missing": lambda: _changed(lambda p: p.manifest["tensors"]["layers.0.key"].pop(DIGEST)),
    "nan_offset": lambda: valid_parts().to_bytes(
        header_text=_header_text(valid_parts()).replace('"data_offsets": [0, 32]', '"data_offsets": [0, NaN]')
    ),
    "duplicate_key": lambda: _header_with('"token_ids": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}'),
    "model_id_with_terminal_escape": lambda: _changed(lambda p: _set(p.manifest["model"], "id", "x\x1b[2Jy")),
    "architecture_with_bidi_override": lambda: _changed(
        lambda p: _set(p.manifest["model"], "architecture", "Qwen\u202eLMsuaC")
    ),
    "lone_surrogate": lambda: _changed(lambda p: _set(p.manifest["model"], "id", "x\ud800y")),
    # issue 26: labels took what names refuse (the one text rule, kvcdn_core.text)
    **LABEL_CASES,
    "header_not_json": lambda: frame(b"{not json at all}", b""),
    "header_not_utf8": lambda: frame(b'{"\xff": 1}', b""),
    "header_length_implausible": lambda: struct.pack("<Q", 1 << 62) + b"{}",
    "truncated_data": lambda: valid_bytes()[:-3],
    "trailing_bytes": lambda: valid_bytes() + b"more",
    "empty_file": lambda: b"",
}
