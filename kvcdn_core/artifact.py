"""The `.kv` artifact: one self-describing safetensors file.

Layout (see docs/artifact-format.md): the safetensors header metadata holds ``kvcdn.format``,
``kvcdn.format_version`` and ``kvcdn.manifest`` (JSON). Token ids are the ``token_ids`` tensor.
Reading the header, the manifest and the token ids is pure Python (no torch), so ``inspect`` and
``search`` stay fast; :func:`load_tensors` reads the data region in one pass and builds tensors on
that buffer without copying.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import struct
import sys
from array import array
from pathlib import Path
from typing import Any

from kvcdn_core.atomic import atomic_path
from kvcdn_core.errors import ArtifactError, KvcdnError

FORMAT_NAME = "kvcdn-kv"
FORMAT_VERSION = 1
META_FORMAT = "kvcdn.format"
META_VERSION = "kvcdn.format_version"
META_MANIFEST = "kvcdn.manifest"
TOKEN_IDS = "token_ids"

# Bytes per read call of load_tensors: hashing starts on a tensor as soon as its bytes are in.
_READ_CHUNK = 16 << 20
# Threads that hash tensors while load_tensors reads (at most the CPU count).
_HASH_WORKERS = 4

# Largest header we accept; safetensors itself caps it at 100 MB.
MAX_HEADER_BYTES = 100_000_000

#: safetensors dtype name → (bytes per element, torch dtype name)
DTYPES = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
}
TORCH_TO_ST = {torch_name: st for st, (_, torch_name) in DTYPES.items()}

#: Layer kinds a manifest may name.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MLA_LATENT = "mla_latent"
LINEAR_ATTENTION = "linear_attention"
RECURRENT_STATE = "recurrent_state"
LAYER_KINDS = (FULL_ATTENTION, SLIDING_WINDOW, MLA_LATENT, LINEAR_ATTENTION, RECURRENT_STATE)
#: Kinds whose cache can be cropped to any shorter prefix.
CROPPABLE_KINDS = (FULL_ATTENTION, MLA_LATENT)

REQUIRED_MANIFEST_KEYS = ("kvcdn_version", "created_at", "model", "compute_dtype", "token_count",
                          "layers", "tensors")


@dataclasses.dataclass
class Header:
    """A parsed and validated artifact header."""

    path: Path
    manifest: dict[str, Any]
    entries: dict[str, dict[str, Any]]  # tensor name → {dtype, shape, data_offsets}
    data_start: int
    file_size: int

    @property
    def token_count(self) -> int:
        return int(self.manifest["token_count"])


def _fail(path, message: str) -> ArtifactError:
    return ArtifactError(f"{path}: {message}")


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of an artifact, without touching the tensor data."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            file_size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"not a kvcdn artifact: file is {file_size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or header_len > file_size - 8:
                if header_len <= MAX_HEADER_BYTES:
                    raise _fail(path, f"truncated: header says {header_len} bytes, file has {file_size - 8}")
                raise _fail(path, "not a kvcdn artifact: not a safetensors file (implausible header length)")
            raw = fh.read(header_len)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (ValueError, UnicodeDecodeError):
        raise _fail(path, "corrupted or not a safetensors file: header is not valid JSON") from None
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or meta.get(META_FORMAT) != FORMAT_NAME:
        raise _fail(path, "not a kvcdn artifact: safetensors file without a kvcdn manifest")
    try:
        version = int(meta.get(META_VERSION, ""))
    except ValueError:
        raise _fail(path, f"corrupted: format version {meta.get(META_VERSION)!r} is not a number") from None
    if version > FORMAT_VERSION:
        raise _fail(path, f"format version {version} is newer than this kvcdn reads ({FORMAT_VERSION}); upgrade kvcdn")
    if version < 1:
        raise _fail(path, f"unknown format version {version}")
    try:
        manifest = json.loads(meta.get(META_MANIFEST, ""))
        if not isinstance(manifest, dict):
            raise ValueError
    except ValueError:
        raise _fail(path, "corrupted: the manifest is not valid JSON") from None
    data_start = 8 + header_len
    result = Header(path, manifest, header, data_start, file_size)
    _validate(result)
    return result


def _check_manifest_types(path, manifest: dict) -> None:
    """The manifest's structure, so that later code can index it without surprises."""
    missing = [k for k in REQUIRED_MANIFEST_KEYS if k not in manifest]
    if missing:
        raise _fail(path, f"corrupted: manifest lacks {', '.join(missing)}")

    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise _fail(path, f"corrupted: manifest {what}")

    count = manifest["token_count"]
    expect(isinstance(count, int) and not isinstance(count, bool) and count >= 0,
           "token_count is not a non-negative integer")
    expect(isinstance(manifest["model"], dict), "model is not an object")
    expect(isinstance(manifest["compute_dtype"], str), "compute_dtype is not a string")
    expect(manifest.get("quantization") is None or isinstance(manifest["quantization"], dict),
           "quantization is neither null nor an object")
    expect(isinstance(manifest["tensors"], dict), "tensors is not an object")
    for name, spec in manifest["tensors"].items():
        expect(isinstance(spec, dict) and isinstance(spec.get("dtype"), str)
               and isinstance(spec.get("shape"), list)
               and all(isinstance(d, int) and not isinstance(d, bool) for d in spec["shape"]),
               f"entry for tensor '{name}' lacks a dtype or an integer shape")
    expect(isinstance(manifest["layers"], list), "layers is not a list")
    for i, layer in enumerate(manifest["layers"]):
        expect(isinstance(layer, dict), f"layer {i} is not an object")
        expect(layer.get("kind") in LAYER_KINDS, f"layer {i} has unknown kind {layer.get('kind')!r}")
        tensors = layer.get("tensors", {})
        expect(isinstance(tensors, dict) and all(isinstance(v, str) for v in tensors.values()),
               f"layer {i} tensors is not a map of names")


def _validate(h: Header) -> None:
    path, manifest = h.path, h.manifest
    _check_manifest_types(path, manifest)
    data_len = 0
    for name, entry in h.entries.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            width = DTYPES[dtype][0]
        except (KeyError, TypeError, ValueError):
            raise _fail(path, f"corrupted: bad header entry for tensor '{name}'") from None
        try:
            count = 1
            for dim in shape:
                count *= int(dim)
            bad = end - start != count * width or start < 0
        except (TypeError, ValueError):
            raise _fail(path, f"corrupted: bad header entry for tensor '{name}'") from None
        if bad:
            raise _fail(path, f"corrupted: tensor '{name}' has {end - start} bytes, its shape needs {count * width}")
        data_len = max(data_len, end)
    actual = h.file_size - h.data_start
    if actual < data_len:
        raise _fail(path, f"truncated: {actual} bytes of tensor data, the header needs {data_len}")
    if actual > data_len:
        raise _fail(path, f"corrupted: {actual - data_len} unexpected trailing bytes")
    for name, spec in manifest["tensors"].items():
        entry = h.entries.get(name)
        if entry is None:
            raise _fail(path, f"corrupted: manifest names tensor '{name}', which the file lacks")
        if list(entry["shape"]) != list(spec["shape"]) or entry["dtype"] != spec["dtype"]:
            raise _fail(path, f"corrupted: tensor '{name}' is {entry['dtype']}{entry['shape']}, "
                              f"the manifest says {spec['dtype']}{spec['shape']}")
    token_entry = h.entries.get(TOKEN_IDS)
    if token_entry is None or token_entry["shape"] != [int(manifest["token_count"])]:
        raise _fail(path, f"corrupted: '{TOKEN_IDS}' tensor missing or not of length token_count")
    for layer in manifest["layers"]:
        for tensor_name in layer.get("tensors", {}).values():
            if tensor_name not in manifest["tensors"]:
                raise _fail(path, f"corrupted: layer {layer.get('index')} names unknown tensor '{tensor_name}'")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    return read_header(path).manifest


def read_token_ids(path: str | os.PathLike, header: Header | None = None) -> list[int]:
    """The artifact's token ids, read without loading the cache tensors (no torch)."""
    h = header or read_header(path)
    entry = h.entries[TOKEN_IDS]
    start, end = entry["data_offsets"]
    codes = {"I64": "q", "I32": "i"}
    if entry["dtype"] not in codes:
        raise _fail(h.path, f"corrupted: '{TOKEN_IDS}' has dtype {entry['dtype']}, expected I64 or I32")
    with open(h.path, "rb") as fh:
        fh.seek(h.data_start + start)
        raw = fh.read(end - start)
    ids = array(codes[entry["dtype"]])
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()


def _iter_tensor_bytes(h: Header, names):
    with open(h.path, "rb") as fh:
        for name in names:
            start, end = h.entries[name]["data_offsets"]
            fh.seek(h.data_start + start)
            yield name, fh.read(end - start)


def check_hashes(header: Header) -> list[str]:
    """Re-hash every tensor the manifest lists; return the names whose sha256 differs."""
    specs = header.manifest["tensors"]
    return [
        name for name, data in _iter_tensor_bytes(header, list(specs))
        if hashlib.sha256(data).hexdigest() != specs[name].get("sha256")
    ]


def load_tensors(header: Header, device: str = "cpu", verify_hashes: bool = True) -> dict[str, Any]:
    """Read the whole data region once and return every tensor as a torch tensor.

    The tensors share one buffer (``torch.frombuffer``), so loading costs one read. With
    ``verify_hashes`` each tensor is hashed by worker threads as soon as its bytes are in (hashlib
    releases the GIL), so the sha256 pass overlaps the read and spreads over cores instead of
    following the read on one core (sha256 is slower than a fast disk on one core). The buffer is
    ``numpy.empty``: no zero-fill pass before the read, and huge pages where the kernel offers them.
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch

    size = header.file_size - header.data_start
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer)
    specs = header.manifest["tensors"]
    order = sorted((header.entries[name]["data_offsets"], name) for name in specs) if verify_hashes else []
    digests: dict[str, Any] = {}

    def digest(start: int, end: int) -> str:
        return hashlib.sha256(view[start:end]).hexdigest()

    workers = min(_HASH_WORKERS, os.cpu_count() or 1)
    hashing = ThreadPoolExecutor(max_workers=workers) if verify_hashes else contextlib.nullcontext()
    with hashing as pool, open(header.path, "rb", buffering=0) as fh:
        fh.seek(header.data_start)
        done = queued = 0
        while done < size:
            n = fh.readinto(view[done:min(done + _READ_CHUNK, size)])
            if not n:
                raise _fail(header.path, "truncated while reading tensor data")
            done += n
            while queued < len(order) and order[queued][0][1] <= done:
                (start, end), name = order[queued]
                digests[name] = pool.submit(digest, start, end)
                queued += 1
    if verify_hashes:
        bad = [name for name, spec in specs.items() if digests[name].result() != spec.get("sha256")]
        if bad:
            raise _fail(header.path, f"corrupted: sha256 mismatch in {len(bad)} tensor(s), first '{bad[0]}'")
    tensors = {}
    for name, entry in header.entries.items():
        start, end = entry["data_offsets"]
        dtype = getattr(torch, DTYPES[entry["dtype"]][1])
        if end == start:
            t = torch.empty(entry["shape"], dtype=dtype)
        else:
            t = torch.frombuffer(buffer, dtype=dtype, offset=start, count=(end - start) // DTYPES[entry["dtype"]][0])
            t = t.view(entry["shape"])
        tensors[name] = t if device == "cpu" else t.to(device)
    return tensors


def tensor_bytes(t) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, as stored in the file."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def write_artifact(path: str | os.PathLike, manifest: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """Write an artifact atomically: temporary file in the same directory, fsync, rename.

    ``tensors`` maps names to torch tensors and must include ``token_ids``. The manifest's
    ``tensors`` table (dtype, shape, sha256) is filled in here.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if TOKEN_IDS not in tensors:
        raise ValueError("an artifact needs a token_ids tensor")
    manifest = dict(manifest)
    table = {}
    prepared = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        prepared[name] = t
        table[name] = {
            "dtype": TORCH_TO_ST[str(t.dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            "sha256": hashlib.sha256(tensor_bytes(t)).hexdigest(),
        }
    manifest["tensors"] = table
    manifest["token_count"] = int(prepared[TOKEN_IDS].numel())
    metadata = {
        META_FORMAT: FORMAT_NAME,
        META_VERSION: str(FORMAT_VERSION),
        META_MANIFEST: json.dumps(manifest, sort_keys=True, ensure_ascii=False),
    }
    check_writable(path)
    try:
        with atomic_path(path) as tmp:
            save_file(prepared, str(tmp), metadata=metadata)
    except OSError as exc:
        raise KvcdnError(f"cannot write '{path}': {exc.strerror or exc}") from None
    return path


def check_writable(path: Path) -> None:
    """Fail early, naming the user's path, when an artifact could not be written there."""
    if path.is_dir():
        raise KvcdnError(f"cannot write '{path}': it is a directory")
    # Nothing is created here (a command that fails later leaves no empty directory behind): the
    # nearest existing directory must let the missing ones be made at write time.
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise KvcdnError(f"cannot write '{path}': '{existing}' is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise KvcdnError(f"cannot write '{path}': directory '{existing}' is not writable")


def summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """The few manifest facts that listings show and uploads declare (the server re-reads them)."""
    model = manifest.get("model") or {}
    quant = manifest.get("quantization")
    return {
        "model_id": model.get("id"),
        "architecture": model.get("architecture"),
        "tokens": int(manifest.get("token_count", 0)),
        "layers": len(manifest.get("layers") or []),
        "dtype": manifest.get("compute_dtype"),
        "quantization": quant.get("scheme") if isinstance(quant, dict) else None,
    }


def reuse_mode(manifest: dict[str, Any]) -> str:
    """``any_prefix`` when every layer can be cropped, else ``whole_prefix``."""
    kinds = {layer["kind"] for layer in manifest["layers"]}
    return "any_prefix" if kinds <= set(CROPPABLE_KINDS) else "whole_prefix"
