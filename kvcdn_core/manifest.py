"""The artifact manifest, typed: what core reads from a `.kv` header, as dataclasses.

:func:`kvcdn_core.artifact.read_header` validates the JSON manifest (keys present, types right);
:meth:`Manifest.from_dict` then gives core typed access instead of string keys. The JSON stays the
format: ``Manifest.raw`` is the validated dict, and adapters still receive each layer's JSON entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcdn_core.artifact import COMPUTE_DTYPES, STATE_KINDS, reuse_mode

ANY_PREFIX = "any_prefix"
WHOLE_PREFIX = "whole_prefix"
__all__ = ["ANY_PREFIX", "COMPUTE_DTYPES", "WHOLE_PREFIX", "LayerEntry", "Manifest", "ModelInfo"]


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


@dataclasses.dataclass(frozen=True)
class LayerEntry:
    """One cache layer: its index, kind, tensor names (role → tensor) and the adapter's own fields."""

    index: int
    kind: str
    tensors: dict[str, str]
    raw: dict[str, Any]  # the JSON entry, as the adapter wrote it (``window`` and the like)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerEntry:
        return cls(int(data["index"]), str(data["kind"]), dict(data.get("tensors") or {}), data)

    @property
    def keeps_state(self) -> bool:
        """A running state (linear attention, recurrent) rather than only per-token keys and values."""
        return self.kind in STATE_KINDS


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
        return WHOLE_PREFIX if WHOLE_PREFIX in (reuse_mode(self.raw), self.declared_reuse) else ANY_PREFIX

    @property
    def layer_dicts(self) -> list[dict[str, Any]]:
        """Each layer's JSON entry, as adapters receive them."""
        return [layer.raw for layer in self.layers]
