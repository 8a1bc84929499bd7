"""Quantized artifacts: quantizing a cache's tensors with a scheme, and dequantizing on load.

The scheme is a :class:`kvcdn_core.contracts.quantizer.Quantizer` the registry finds; the workflow
around this (files, verification, the event record) is :mod:`kvcdn_core.quant.service`.

Storage rule (see docs/quantization.md): a quantized tensor keeps its name for its codes (so the
manifest's layer entries still name tensors the file holds) and adds ``<name>.<part>`` tensors for
the rest. Layers of a kind the scheme does not support keep their tensors unchanged. The manifest's
``quantization`` block records the scheme, its parameters, the target and storage dtypes and what was
done to every layer, so :func:`dequantize_tensors` can rebuild the exact tensor names and shapes an
unquantized artifact has: everything that loads an artifact dequantizes transparently. This module
imports torch lazily.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
from collections.abc import Callable
from typing import Any

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import Manifest, manifest_of
from kvcdn_core.contracts.quantizer import (
    DTYPE_ALIASES,
    QUANT_BLOCK_VERSION,
    REFUSED_TARGETS,
    STORAGE_DTYPE_SCHEMES,
    TARGET_DTYPES,
    Quantizer,
    Record,
    role_of,
)
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.plugin_host.registry import claim_note, quantizer_for


def normalize_target_dtype(requested: str | None) -> tuple[str | None, str | None]:
    """``--target-dtype`` → ``(target float dtype or None, scheme implied by a storage dtype or None)``.

    F32/F16/BF16 are what the artifact dequantizes to on load. FP8 and I8 name the storage dtype
    instead: they choose the scheme that stores it (fp8, int8) and leave the target at the compute
    dtype. Everything else is refused with the reason and what to use.
    """
    if requested is None:
        return None, None
    name = requested.strip().upper()
    name = DTYPE_ALIASES.get(name, name)
    if name in TARGET_DTYPES:
        return name, None
    if name in STORAGE_DTYPE_SCHEMES:
        return None, STORAGE_DTYPE_SCHEMES[name]
    if name in REFUSED_TARGETS:
        raise KvcdnError(f"target dtype {name} is not supported: {REFUSED_TARGETS[name]}")
    raise KvcdnError(
        f"unknown target dtype '{requested}': use F32, F16 or BF16 (what the artifact "
        "dequantizes to on load), or FP8/I8 to pick the fp8/int8 storage scheme"
    )


# -- quantizing a whole cache ---------------------------------------------------------------------


@dataclasses.dataclass
class ErrorStats:
    """Dequantization error of one tensor role (key, value) across the quantized layers."""

    max_abs: float = 0.0
    sum_abs: float = 0.0
    count: int = 0
    max_ref: float = 0.0  # largest |x| seen, to put max_abs in proportion

    def add(self, x, approx) -> None:
        diff = (x.float() - approx.float()).abs()
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sum_abs += float(diff.double().sum())
            self.count += diff.numel()
            self.max_ref = max(self.max_ref, float(x.float().abs().max()))

    def as_dict(self) -> dict:
        return {
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / self.count if self.count else 0.0,
            "max_relative": self.max_abs / self.max_ref if self.max_ref else 0.0,
            "elements": self.count,
        }


@dataclasses.dataclass
class QuantResult:
    manifest: dict
    tensors: dict[str, Any]
    errors: dict[str, ErrorStats]
    quantized_layers: int
    kept_layers: int


def quantize_cache(
    manifest: dict[str, Any] | Manifest, tensors: dict[str, Any], quantizer: Quantizer, target_dtype: str | None = None
) -> QuantResult:
    """Quantize an unquantized artifact's tensors; returns the new manifest and stored tensors.

    ``manifest`` and ``tensors`` are what :func:`kvcdn_core.artifact.read_header` and
    :func:`kvcdn_core.artifact.load_tensors` give (or a freshly exported cache). The manifest's
    ``tensors`` table is rebuilt by the writer. A read header's manifest comes typed
    (:func:`kvcdn_core.artifact.manifest.manifest_of`); a freshly exported one is only a dict.
    """
    typed = manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest)
    raw = typed.raw
    if typed.quantization:
        raise KvcdnError(
            f"the input is already quantized (scheme {typed.scheme}); quantize the "
            "unquantized artifact instead of stacking quantization errors"
        )
    target = target_dtype or artifact.TORCH_TO_ST.get(typed.compute_dtype, "F32")
    if target not in TARGET_DTYPES:
        raise KvcdnError(f"target dtype {target} is not one of {', '.join(TARGET_DTYPES)}")
    stored = {artifact.TOKEN_IDS: tensors[artifact.TOKEN_IDS]}
    errors: dict[str, ErrorStats] = {}
    layer_records = []
    done = kept = 0
    for layer in typed.layers:
        if not quantizer.supports(layer.kind):
            kept += 1
            for full in layer.tensors.values():
                stored[full] = tensors[full]
            layer_records.append(
                {
                    "index": layer.index,
                    "kind": layer.kind,
                    "action": "full_precision",
                    "reason": f"scheme {quantizer.scheme} does not support {layer.kind} layers",
                }
            )
            continue
        records = {}
        for local, full in layer.tensors.items():
            t = tensors[full]
            if not t.is_floating_point() or t.dim() < 2:
                stored[full] = t
                records[local] = {"name": full, "action": "full_precision", "reason": "not a float cache tensor"}
                continue
            role = role_of(local)
            parts, record = quantizer.quantize(role, t)
            for suffix, part in parts.items():
                stored[f"{full}.{suffix}" if suffix else full] = part
            record = {"name": full, "action": "quantized", "parts": sorted(parts), **record}
            records[local] = record
            errors.setdefault(role, ErrorStats()).add(t, quantizer.dequantize(parts, record))
        done += 1
        layer_records.append({"index": layer.index, "kind": layer.kind, "action": "quantized", "tensors": records})
    new = copy.deepcopy(raw)
    new.pop("tensors", None)
    new["created_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    new["quantization"] = {
        "version": QUANT_BLOCK_VERSION,
        "scheme": quantizer.scheme,
        "parameters": dict(quantizer.params),
        "target_dtype": target,
        "storage_dtype": quantizer.storage_dtype,
        "source_dtype": artifact.TORCH_TO_ST.get(typed.compute_dtype, typed.compute_dtype),
        "source_created_at": raw.get("created_at"),
        "layers": layer_records,
    }
    return QuantResult(new, stored, errors, done, kept)


# -- dequantizing on load ----------------------------------------------------------------------


def dequantize_tensors(header: artifact.Header, device: str = "cpu", verify_hashes: bool = True) -> dict[str, Any]:
    """Load a quantized artifact and return the tensors an unquantized one would hold.

    Same names (each layer's tensors and ``token_ids``), same shapes, in the target dtype;
    :func:`kvcdn_core.runtime.load_cache` calls this when the manifest has a ``quantization`` block
    (its streamed load goes through :class:`QuantizedLayers` one layer at a time instead).
    """
    layers = QuantizedLayers(header)
    raw = artifact.load_tensors(header, device=device, verify_hashes=verify_hashes)
    out = {artifact.TOKEN_IDS: raw[artifact.TOKEN_IDS]}
    for position in range(len(layers.layers)):
        out.update(layers.dequantize_layer(position, raw.__getitem__))
    return out


class QuantizedLayers:
    """A quantized artifact's layers, dequantized one at a time through its scheme's quantizer.

    The whole load (:func:`dequantize_tensors`) and the layer-by-layer one
    (:mod:`kvcdn_core.artifact.layer_stream`) share it, so both give the same tensors bit for bit. The
    quantization block is checked here, before any tensor is read.
    """

    def __init__(self, header: artifact.Header) -> None:
        import torch

        self.path = header.path
        manifest = manifest_of(header)
        q = manifest.quantization or {}
        try:
            version = int(q.get("version", 1))
            scheme = q["scheme"]
            target = q["target_dtype"]
            layer_records = q["layers"]
            params = q.get("parameters") or {}
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(
                f"{header.path}: corrupted: the quantization block lacks scheme, target_dtype or layers"
            ) from None
        if version > QUANT_BLOCK_VERSION:
            raise ArtifactError(
                f"{header.path}: quantization block version {version} is newer than this kvcdn reads "
                f"({QUANT_BLOCK_VERSION}); upgrade kvcdn"
            )
        if target not in TARGET_DTYPES:
            raise ArtifactError(f"{header.path}: unknown quantization target dtype {target!r}")
        try:
            self.quantizer = quantizer_for(scheme)(**params)
        except KvcdnError as exc:
            note = claim_note("schemes", scheme)
            if not note:
                raise
            raise KvcdnError(f"{header.path}: {exc}{note}") from None
        self.dtype = getattr(torch, TARGET_DTYPES[target])
        self.layers = manifest.layers
        by_index = {rec.get("index"): rec for rec in layer_records}
        self.records: list[dict[str, Any]] = []
        for layer in self.layers:
            rec = by_index.get(layer.index)
            if rec is None:
                raise ArtifactError(
                    f"{header.path}: corrupted: the quantization block has no record for layer {layer.index}"
                )
            self.records.append(rec)

    def _record(self, position: int, local: str) -> Record | None:
        """The record of a quantized tensor, None for one stored in full precision."""
        rec = self.records[position]
        trec = rec.get("tensors", {}).get(local) if rec.get("action") == "quantized" else None
        return trec if trec is not None and trec.get("action") == "quantized" else None

    def stored_names(self, position: int) -> list[str]:
        """The file's tensors that layer ``position`` (in manifest order) is rebuilt from."""
        names: list[str] = []
        for local, full in self.layers[position].tensors.items():
            trec = self._record(position, local)
            parts = trec.get("parts", [""]) if trec else [""]
            names.extend(f"{full}.{part}" if part else full for part in parts)
        return names

    def dequantize_layer(self, position: int, stored: Callable[[str], Any]) -> dict[str, Any]:
        """Layer ``position``'s tensors by full name, as an unquantized artifact holds them;
        ``stored(name)`` gives a tensor of the file."""
        out = {}
        for local, full in self.layers[position].tensors.items():
            trec = self._record(position, local)
            if trec is None:
                out[full] = stored(full)
                continue
            try:
                parts = {p: stored(f"{full}.{p}" if p else full) for p in trec["parts"]}
                value = self.quantizer.dequantize(parts, trec, self.dtype)
            except (KeyError, RuntimeError, ValueError) as exc:
                raise ArtifactError(f"{self.path}: corrupted: cannot dequantize '{full}': {exc}") from None
            if list(value.shape) != list(trec["shape"]):
                raise ArtifactError(
                    f"{self.path}: corrupted: '{full}' dequantizes to {list(value.shape)}, "
                    f"the record says {trec['shape']}"
                )
            out[full] = value
        return out
