"""The artifact manifest, typed: what core and plugins read from a `.kv` header, as dataclasses.

:func:`kvcdn_core.artifact.read_header` validates the JSON manifest (keys present, types right);
:meth:`Manifest.from_dict` then gives typed access instead of string keys. The JSON stays the
format: ``Manifest.raw`` is the validated dict, and :meth:`LayerEntry.to_dict` writes a layer's
entry back as the same JSON. Adapters build and read :class:`LayerEntry`, never the dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from kvcdn_core.artifact import COMPUTE_DTYPES, CROPPABLE_KINDS, STATE_KINDS, Header

ANY_PREFIX = "any_prefix"
WHOLE_PREFIX = "whole_prefix"
__all__ = [
    "ANY_PREFIX",
    "COMPUTE_DTYPES",
    "WHOLE_PREFIX",
    "LayerEntry",
    "Manifest",
    "ModelInfo",
    "manifest_of",
    "reuse_of",
]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The model an artifact was made with, and its fingerprint."""

    id: str | None = None
    revision: str | None = None
    family: str | None = None
    architecture: str | None = None
    config_sha256: str | None = None
    tokenizer_sha256: str | None = None
    weights_sha256: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ModelInfo:
        data = data or {}
        return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})


#: The JSON keys :class:`LayerEntry` types; any other key of a layer entry is a family field.
_TYPED_KEYS = ("index", "kind", "tensors", "window", "cumulative_length")


@dataclasses.dataclass(frozen=True)
class LayerEntry:
    """One cache layer of the manifest.

    ``tensors`` maps a role (``key``, ``value``, ``conv_state``...) to a tensor name of the file;
    ``window`` and ``cumulative_length`` are a sliding-window layer's (None otherwise); a family
    plugin keeps what else it records (``conv_kernel``, ``kv_lora_rank``...) in ``family_fields``.
    """

    index: int
    kind: str
    tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    window: int | None = None
    cumulative_length: int | None = None
    family_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerEntry:
        """The entry of a validated manifest's ``layers`` list."""
        return cls(
            index=int(data["index"]),
            kind=str(data["kind"]),
            tensors=dict(data.get("tensors") or {}),
            window=data.get("window"),
            cumulative_length=data.get("cumulative_length"),
            family_fields={k: v for k, v in data.items() if k not in _TYPED_KEYS},
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry, as the manifest stores it (fields that are None are left out)."""
        data: dict[str, Any] = {"index": self.index, "kind": self.kind}
        if self.window is not None:
            data["window"] = self.window
        if self.cumulative_length is not None:
            data["cumulative_length"] = self.cumulative_length
        return {**data, **self.family_fields, "tensors": dict(self.tensors)}

    def with_fields(self, **family_fields: Any) -> LayerEntry:
        """A copy with these family fields added (or replaced)."""
        return dataclasses.replace(self, family_fields={**self.family_fields, **family_fields})

    @property
    def keeps_state(self) -> bool:
        """A running state (linear attention, recurrent) rather than only per-token keys and values."""
        return self.kind in STATE_KINDS

    @property
    def croppable(self) -> bool:
        """Whether the layer can be cut to any shorter prefix (full attention, MLA latent)."""
        return self.kind in CROPPABLE_KINDS


def reuse_of(layers: Iterable[LayerEntry]) -> str:
    """``any_prefix`` when every layer can be cropped, else ``whole_prefix``."""
    return ANY_PREFIX if all(layer.croppable for layer in layers) else WHOLE_PREFIX


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A validated manifest: the fields core reads, typed, and the JSON it came from."""

    kvcdn_version: str
    created_at: str
    model: ModelInfo
    compute_dtype: str
    token_count: int
    layers: tuple[LayerEntry, ...]
    quantization: dict[str, Any] | None
    declared_reuse: str | None
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        quant = data.get("quantization")
        return cls(
            kvcdn_version=str(data.get("kvcdn_version")),
            created_at=str(data.get("created_at")),
            model=ModelInfo.from_dict(data.get("model")),
            compute_dtype=str(data.get("compute_dtype")),
            token_count=int(data.get("token_count", 0)),
            layers=tuple(LayerEntry.from_dict(layer) for layer in data.get("layers") or []),
            quantization=quant if isinstance(quant, dict) and quant else None,
            declared_reuse=data.get("reuse"),
            raw=data,
        )

    @property
    def scheme(self) -> str | None:
        """The quantization scheme, or None for an unquantized artifact."""
        return self.quantization.get("scheme") if self.quantization else None

    @property
    def reuse(self) -> str:
        """``any_prefix`` when every layer can be cropped (and the writer did not say otherwise), else
        ``whole_prefix``: then only the whole artifact can be a prefix of a longer prompt."""
        return WHOLE_PREFIX if WHOLE_PREFIX in (reuse_of(self.layers), self.declared_reuse) else ANY_PREFIX


def manifest_of(header: Header) -> Manifest:
    """A read header's manifest, typed once: every later call with the same header returns the same
    object, so a command that opens, checks and loads an artifact parses its manifest one time."""
    if header.typed_manifest is None:
        header.typed_manifest = Manifest.from_dict(header.manifest)
    return header.typed_manifest
