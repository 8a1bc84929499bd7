"""The `.kv` artifact: one self-describing safetensors file.

Layout (see docs/artifact-format.md): the safetensors header metadata holds ``kvcdn.format``,
``kvcdn.format_version`` and ``kvcdn.manifest`` (JSON). Token ids are the ``token_ids`` tensor.
Reading the header, the manifest and the token ids is pure Python (no torch), so ``inspect`` and
``search`` stay fast; :func:`load_tensors` reads the data region in one pass and builds tensors on
that buffer without copying (:mod:`kvcdn_core.artifact.tensor_io`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import struct
import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvcdn_core.artifact import digests, tensor_io
from kvcdn_core.atomic import atomic_path
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.paths import check_writable
from kvcdn_core.text import is_printable_text

if TYPE_CHECKING:  # the package importing its own module: not a cycle (tests/test_layout.py)
    from kvcdn_core.artifact.manifest import Manifest

FORMAT_NAME = "kvcdn-kv"
#: The version written. 2: tensors carry BLAKE3 digests; 1 (still read): SHA-256 (:mod:`kvcdn_core.artifact.digests`).
FORMAT_VERSION = 2
META_FORMAT = "kvcdn.format"
META_VERSION = "kvcdn.format_version"
META_MANIFEST = "kvcdn.manifest"
TOKEN_IDS = "token_ids"


def layer_tensor_name(index: int, role: str) -> str:
    """The name of cache layer ``index``'s tensor ``role`` (``key``, ``value``, ``latent``...): the
    one naming rule of every writer (core's runtime, the vLLM connector), so readers may rely on it."""
    return f"layers.{index}.{role}"


#: Largest header accepted. A real header is mostly the manifest's ``context`` (the document, about
#: 4-5 bytes per token of text) plus about 0.3 KB per tensor: 32 KB for a 36-layer model and 4k tokens
#: (docs/artifact-format.md has the measurements), so 8 MiB holds the context of more than a million
#: tokens, whose cache is tens of gigabytes. safetensors itself allows 100 MB, which let a padded
#: header cost every reader half a gigabyte.
MAX_HEADER_BYTES = 8 << 20
#: Deepest JSON nesting accepted in the header and in the manifest (real ones: 3 and 7).
MAX_JSON_DEPTH = 32
#: Most JSON tokens (strings and brackets) in the header or the manifest: a real one has about 30
#: per tensor (9 000 for an int4 artifact of 36 layers). With the size cap it bounds what a parse
#: allocates to a few times the header's size.
MAX_JSON_TOKENS = 200_000
#: Most dimensions of a tensor.
MAX_RANK = 16

#: safetensors dtype name → (bytes per element, torch dtype name); defined with the tensor reader
DTYPES = tensor_io.DTYPES
TORCH_TO_ST = {torch_name: st for st, (_, torch_name) in DTYPES.items()}
#: dtypes a cache is computed in (the manifest's ``compute_dtype``)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
#: ``token_ids`` dtypes → array type codes
TOKEN_ID_CODES = {"I64": "q", "I32": "i"}

#: Layer kinds a manifest may name.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MLA_LATENT = "mla_latent"
#: An MLA latent with DeepSeek sparse attention's indexer keys (DeepSeek-V3.2, GLM-MoE-DSA).
MLA_INDEXED = "mla_indexed"
LINEAR_ATTENTION = "linear_attention"
RECURRENT_STATE = "recurrent_state"
#: One cache layer holding both a linear-attention (Mamba) state and full-attention keys/values
#: (Falcon-H1, Zamba, Zamba2). Added after the other kinds: a reader without it refuses it as unknown.
LINEAR_AND_FULL_ATTENTION = "linear_and_full_attention"
LAYER_KINDS = (
    FULL_ATTENTION,
    SLIDING_WINDOW,
    MLA_LATENT,
    MLA_INDEXED,
    LINEAR_ATTENTION,
    RECURRENT_STATE,
    LINEAR_AND_FULL_ATTENTION,
)
#: Roles of a ``linear_and_full_attention`` layer: keys and values, and one or more states
#: (``conv_state``, ``recurrent_state``, then ``conv_state.1``... for a layer with several).
_STATE_ROLE = re.compile(r"(conv_state|recurrent_state)(\.[1-9][0-9]*)?")
#: Kinds holding a running state (kept in its own, often wider, dtype) rather than only keys/values.
STATE_KINDS = (LINEAR_ATTENTION, RECURRENT_STATE, LINEAR_AND_FULL_ATTENTION)
#: Tensor roles of MLA layer entries: the latent and the rotary key, and (``mla_indexed`` only) the
#: DSA indexer key; and the integer widths an ``mla_indexed`` entry must give.
MLA_ROLES = ("latent", "rotary_key", "indexer_key")
MLA_INDEXED_WIDTHS = ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim")
#: Kinds whose cache can be cropped to any shorter prefix.
CROPPABLE_KINDS = (FULL_ATTENTION, MLA_LATENT, MLA_INDEXED)

REQUIRED_MANIFEST_KEYS = ("kvcdn_version", "created_at", "model", "compute_dtype", "token_count", "layers", "tensors")


@dataclasses.dataclass
class Header:
    """A parsed and validated artifact header."""

    path: Path
    manifest: dict[str, Any]
    entries: dict[str, dict[str, Any]]  # tensor name → {dtype, shape, data_offsets}
    data_start: int
    file_size: int
    format_version: int = FORMAT_VERSION
    #: The manifest typed, made once by :func:`kvcdn_core.artifact.manifest.manifest_of` and kept here.
    typed_manifest: Manifest | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def token_count(self) -> int:
        return int(self.manifest["token_count"])

    @property
    def digest(self) -> str:
        """The algorithm of the tensors' digests, which is also their key in the manifest entries."""
        return digests.BY_FORMAT_VERSION[self.format_version]


def _fail(path: Any, message: str) -> ArtifactError:
    return ArtifactError(f"{path}: {message}")


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and strictly validate the header of an artifact, without touching the tensor data.

    Every reader (CLI, hosted client, server) goes through here: any malformed input is an
    :class:`ArtifactError` with a one-line message, and what the parse may allocate is bounded by
    :data:`MAX_HEADER_BYTES`, :data:`MAX_JSON_DEPTH` and :data:`MAX_JSON_TOKENS`.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return read_header_from(fh, os.fstat(fh.fileno()).st_size, path)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from None


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    """Up to ``n`` bytes: fewer only at the end of the stream (a network stream may return less per read)."""
    parts, got = [], 0
    while got < n:
        part = stream.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_header_from(stream: IO[bytes], file_size: int, path: Any) -> Header:
    """:func:`read_header` of an artifact of ``file_size`` bytes open as ``stream`` (at its start):
    a stored object's header without fetching its data. ``path`` names it in messages."""
    try:
        prefix = _read_exact(stream, 8)
        if len(prefix) < 8:
            raise _fail(path, f"not a kvcdn artifact: file is {file_size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            if header_len < 1 << 32 and header_len <= file_size - 8:
                raise _fail(
                    path, f"refused: header of {header_len} bytes is over the {MAX_HEADER_BYTES >> 20} MiB limit"
                )
            raise _fail(path, "not a kvcdn artifact: not a safetensors file (implausible header length)")
        if header_len > file_size - 8:
            raise _fail(path, f"truncated: header says {header_len} bytes, file has {file_size - 8}")
        raw = _read_exact(stream, header_len)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from None
    return parse_header(path, raw, file_size)


def parse_header(path: Any, raw: bytes, file_size: int) -> Header:
    """Validate a header's bytes (what follows the 8-byte length) as :func:`read_header` does, for
    a file of ``file_size`` bytes; ``path`` names the file (or the object) in messages.

    For readers that hold the header apart from its file (the chunk store's records).
    """
    header_len = len(raw)
    if header_len > MAX_HEADER_BYTES:
        raise _fail(path, f"refused: header of {header_len} bytes is over the {MAX_HEADER_BYTES >> 20} MiB limit")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(path, "corrupted: the header is not UTF-8") from None
    del raw  # a hostile header may be large: hold one copy at a time
    header = _parse_json(path, text, "header")
    del text
    if not isinstance(header, dict):
        raise _fail(path, "corrupted or not a safetensors file: header is not valid JSON")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get(META_FORMAT) != FORMAT_NAME:
        raise _fail(path, "not a kvcdn artifact: safetensors file without a kvcdn manifest")
    unknown = next((k for k in meta if k not in (META_FORMAT, META_VERSION, META_MANIFEST)), None)
    if unknown is not None:
        raise _fail(path, f"corrupted: unknown metadata key {unknown!r}")
    bad_meta = next((k for k, v in meta.items() if not isinstance(v, str)), None)
    if bad_meta is not None:
        raise _fail(path, f"corrupted: metadata '{bad_meta}' is not a string")
    version = meta.get(META_VERSION, "")
    if not (version.isascii() and version.isdigit() and len(version) <= 9):
        raise _fail(path, f"corrupted: format version {version!r} is not a number")
    if int(version) > FORMAT_VERSION:
        raise _fail(
            path, f"format version {int(version)} is newer than this kvcdn reads ({FORMAT_VERSION}); upgrade kvcdn"
        )
    if int(version) not in digests.BY_FORMAT_VERSION:
        raise _fail(path, f"unknown format version {int(version)}")
    manifest = _parse_json(path, meta.pop(META_MANIFEST, ""), "manifest")
    if not isinstance(manifest, dict):
        raise _fail(path, "corrupted: the manifest is not a JSON object")
    result = Header(path, manifest, header, 8 + header_len, file_size, int(version))
    _check_header_structure(result)
    return result


def check_file(path: str | os.PathLike[str]) -> Header:
    """:func:`read_header` plus :func:`check_hashes` and the token ids: the whole file is what its
    manifest promises.

    For readers that accept a file from outside and keep it (the hosted server's confirm-upload):
    any problem, structural, a tensor whose bytes do not hash to its manifest digest, or a negative
    token id, is an :class:`ArtifactError` (HTTP 422 there).

    Memory stays bounded whatever the file's size (:mod:`kvcdn_core.artifact.stream_check`): the tensors are
    hashed as the file streams past, and the token ids are checked a piece at a time.
    """
    header = read_header(path)
    bad = check_hashes(header)
    if bad:
        raise _fail(header.path, f"corrupted: {header.digest} mismatch in {len(bad)} tensor(s), first '{bad[0]}'")
    _check_token_ids(header)
    return header


def _check_token_ids(h: Header, piece: int = 1 << 20) -> None:
    """No negative token id, read ``piece`` bytes at a time (an upload may hold billions of ids)."""
    entry = h.entries[TOKEN_IDS]
    code = TOKEN_ID_CODES[entry["dtype"]]
    start, end = entry["data_offsets"]
    width = array(code).itemsize
    piece -= piece % width
    with open(h.path, "rb") as fh:
        fh.seek(h.data_start + start)
        left = end - start
        while left:
            raw = fh.read(min(piece, left))
            if not raw or len(raw) % width:
                raise _fail(h.path, "truncated while reading token ids")
            ids = array(code, raw)
            if sys.byteorder != "little":
                ids.byteswap()
            if min(ids) < 0:
                raise _fail(h.path, f"corrupted: '{TOKEN_IDS}' holds a negative token id")
            left -= len(raw)


# What the pre-parse scan counts: a whole JSON string (unrolled, so re matches it in one pass), or
# a bracket. Numbers are not counted: the size cap bounds what they cost.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
# What the short-text scan deletes from the text outside strings: all but the brackets.
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# A \uD800-\uDFFF escape: only then can a parsed string hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _parse_json(path: Any, text: str, what: str) -> Any:
    """``json.loads`` of untrusted text, after checking its nesting depth and token count.

    The scan runs before the parser and stops at the first limit passed, so a hostile document can
    neither exhaust the recursion limit (50 000 nested brackets) nor turn megabytes into hundreds of
    megabytes of Python objects; it allocates nothing per token. Duplicate keys, ``NaN`` and
    ``Infinity`` (which other JSON readers refuse or read differently) are refused too.
    """
    if len(text) <= MAX_JSON_TOKENS:  # too short to pass the token limit: only the depth to check
        if _depth_outside_strings(text) > MAX_JSON_DEPTH:
            raise _fail(path, f"refused: the {what} nests deeper than {MAX_JSON_DEPTH} levels")
        return _loads(path, text, what)
    depth = tokens = 0
    for match in _JSON_TOKEN.finditer(text):
        tokens += 1
        if tokens > MAX_JSON_TOKENS:
            raise _fail(path, f"refused: the {what} has more than {MAX_JSON_TOKENS} JSON tokens")
        char = match.group()
        if char in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise _fail(path, f"refused: the {what} nests deeper than {MAX_JSON_DEPTH} levels")
        elif char in "]}":
            depth -= 1
    return _loads(path, text, what)


def _depth_outside_strings(text: str) -> int:
    """The deepest nesting of brackets outside strings, by C-level passes over the text (the token
    loop spent most of a header's parse). Exact for any text ``json.loads`` accepts: there, with the
    escaped backslashes and then the escaped quotes dropped, every quote left opens or closes a
    string, so the text outside strings is every other piece between quotes. Other text may be
    misjudged, but the parser then refuses it (its own recursion guard stops a deep one)."""
    plain = text.replace("\\\\", "").replace('\\"', "")
    brackets = _NOT_BRACKET.sub("", "".join(plain.split('"')[::2]))
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def _loads(path: Any, text: str, what: str) -> Any:
    """``json.loads`` of text :func:`_parse_json` has scanned."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise _fail(path, f"corrupted: the {what} is not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise _fail(path, f"corrupted: the {what} holds a lone UTF-16 surrogate (not text)")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value holds a string that cannot be encoded (``"\\ud800"`` alone)."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_label(value: Any) -> bool:
    """A string fit to print as a name: the text rule of every shown string (kvcdn_core.text)."""
    return is_printable_text(value)


def _is_count(value: Any) -> bool:
    """A non-negative JSON integer (``true`` and ``1.0`` are not)."""
    return type(value) is int and value >= 0


def _check_manifest_types(h: Header) -> None:
    """The manifest's structure, so that later code can index it without surprises."""
    path, manifest = h.path, h.manifest
    missing = [k for k in REQUIRED_MANIFEST_KEYS if k not in manifest]
    if missing:
        raise _fail(path, f"corrupted: manifest lacks {', '.join(missing)}")

    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise _fail(path, f"corrupted: manifest {what}")

    def optional(container: dict[str, Any], key: str, kind: Any) -> bool:
        return container.get(key) is None or isinstance(container[key], kind)

    expect(_is_label(manifest["kvcdn_version"]), "kvcdn_version is not a printable string")
    expect(_is_label(manifest["created_at"]), "created_at is not a printable string")
    expect(_is_count(manifest["token_count"]), "token_count is not a non-negative integer")
    model = manifest["model"]
    expect(isinstance(model, dict), "model is not an object")
    expect(_is_label(model.get("id")) and model["id"] != "", "model.id is not a non-empty printable string")
    for key in ("revision", "family", "architecture", "config_sha256", "tokenizer_sha256", "weights_sha256"):
        expect(model.get(key) is None or _is_label(model[key]), f"model.{key} is not a printable string")
    expect(
        manifest["compute_dtype"] in COMPUTE_DTYPES,
        f"compute_dtype {manifest['compute_dtype']!r} is not one of {', '.join(COMPUTE_DTYPES)}",
    )
    expect(optional(manifest, "context", str), "context is not a string")
    expect(manifest.get("reuse") in (None, "any_prefix", "whole_prefix"), "reuse is not any_prefix or whole_prefix")
    quant = manifest.get("quantization")
    expect(quant is None or isinstance(quant, dict), "quantization is neither null nor an object")
    if quant is not None:
        _check_quantization(expect, quant)
    expect(isinstance(manifest["tensors"], dict), "tensors is not an object")
    for name, spec in manifest["tensors"].items():
        expect(_is_label(name), f"tensor name {name!r} is not printable")
        expect(
            isinstance(spec, dict)
            and isinstance(spec.get("dtype"), str)
            and isinstance(spec.get("shape"), list)
            and all(_is_count(d) for d in spec["shape"]),
            f"entry for tensor '{name}' lacks a dtype or a shape of non-negative integers",
        )
        expect(
            isinstance(spec.get(h.digest), str) and digests.HEX.fullmatch(spec[h.digest]) is not None,
            f"entry for tensor '{name}' lacks a {h.digest} digest (format version {h.format_version})",
        )
    expect(isinstance(manifest["layers"], list), "layers is not a list")
    for i, layer in enumerate(manifest["layers"]):
        expect(isinstance(layer, dict), f"layer {i} is not an object")
        expect(_is_count(layer.get("index")), f"layer {i} has no non-negative integer index")
        if isinstance(layer.get("kind"), str) and layer["kind"] not in LAYER_KINDS and _is_label(layer["kind"]):
            raise _fail(
                path,
                f"layer {i} has kind {layer['kind']!r}, which this kvcdn does not know (it reads "
                f"{', '.join(LAYER_KINDS)}); a newer kvcdn probably wrote it: upgrade kvcdn to read it",
            )
        expect(layer.get("kind") in LAYER_KINDS, f"layer {i} has unknown kind {layer.get('kind')!r}")
        tensors = layer.get("tensors", {})
        expect(
            isinstance(tensors, dict) and all(isinstance(v, str) for v in tensors.values()),
            f"layer {i} tensors is not a map of names",
        )
        unknown = next((t for t in tensors.values() if t not in manifest["tensors"]), None)
        expect(unknown is None, f"layer {i} names unknown tensor '{unknown}'")
        if layer["kind"] == SLIDING_WINDOW:
            expect(
                _is_count(layer.get("window")) and layer["window"] > 0 and _is_count(layer.get("cumulative_length")),
                f"layer {i} lacks an integer window and cumulative_length",
            )
        if layer["kind"] == LINEAR_AND_FULL_ATTENTION:
            roles = set(tensors)
            expect(
                {"key", "value"} <= roles
                and len(roles) > 2
                and all(_STATE_ROLE.fullmatch(r) for r in roles - {"key", "value"})
                and _is_count(layer.get("conv_kernel")),
                f"layer {i} ('{LINEAR_AND_FULL_ATTENTION}') needs key, value, state tensors "
                "(conv_state, recurrent_state...) and an integer conv_kernel",
            )
        if layer["kind"] == MLA_INDEXED:
            expect(
                set(MLA_ROLES) <= set(tensors)
                and all(_is_count(layer.get(k)) and layer[k] > 0 for k in MLA_INDEXED_WIDTHS),
                f"layer {i} ({MLA_INDEXED}) lacks the {'/'.join(MLA_ROLES)} tensors or an integer "
                f"{', '.join(MLA_INDEXED_WIDTHS)}",
            )


def _check_quantization(expect: Callable[[bool, str], None], q: dict[str, Any]) -> None:
    """The quantization block's common structure (docs/quantization.md); its scheme checks the rest."""
    expect(
        isinstance(q.get("scheme"), str) and isinstance(q.get("target_dtype"), str),
        "quantization lacks a scheme or a target_dtype",
    )
    expect(q.get("version") is None or _is_count(q["version"]), "quantization version is not an integer")
    expect(q.get("parameters") is None or isinstance(q["parameters"], dict), "quantization parameters is not an object")
    expect(isinstance(q.get("layers"), list), "quantization layers is not a list")
    for i, record in enumerate(q["layers"]):
        expect(
            isinstance(record, dict) and _is_count(record.get("index")),
            f"quantization layer {i} is not an object with an integer index",
        )
        tensors = record.get("tensors", {})
        expect(
            isinstance(tensors, dict) and all(isinstance(t, dict) for t in tensors.values()),
            f"quantization layer {i} tensors is not a map of objects",
        )
        for role, t in tensors.items():
            if t.get("action") == "quantized":
                expect(
                    isinstance(t.get("parts"), list)
                    and all(isinstance(p, str) for p in t["parts"])
                    and isinstance(t.get("shape"), list)
                    and all(_is_count(d) for d in t["shape"]),
                    f"quantization layer {i} tensor '{role}' lacks parts or an integer shape",
                )


def _check_header_structure(h: Header) -> None:
    """The header alone describes a well-formed file: typed manifest, tensors that tile the data region
    exactly, the same tensors in the header and the manifest. Reads no tensor bytes (their digests are
    :func:`check_file`'s; exactness against a prefill is :mod:`kvcdn_core.exactness`'s)."""
    path, manifest = h.path, h.manifest
    _check_manifest_types(h)
    spans = []
    for name, entry in h.entries.items():
        if not (isinstance(entry, dict) and entry.keys() == {"dtype", "shape", "data_offsets"}):
            raise _fail(path, f"corrupted: header entry for tensor '{name}' is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _fail(path, f"corrupted: tensor '{name}' has unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(_is_count(d) for d in shape)):
            raise _fail(path, f"corrupted: tensor '{name}' has a shape that is not a list of non-negative integers")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise _fail(path, f"corrupted: tensor '{name}' has data_offsets that are not [start, end] integers")
        need = math.prod(shape) * DTYPES[dtype][0]
        if offsets[1] - offsets[0] != need:
            raise _fail(path, f"corrupted: tensor '{name}' has {offsets[1] - offsets[0]} bytes, its shape needs {need}")
        spans.append((offsets[0], offsets[1], name))
    # The tensors must tile the data region exactly: no gap, no overlap, nothing after the last.
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            raise _fail(
                path,
                f"corrupted: tensor '{name}' starts at byte {start} of the data, expected {end} "
                f"({'overlap' if start < end else 'gap'})",
            )
        end = stop
    actual = h.file_size - h.data_start
    if actual < end:
        raise _fail(path, f"truncated: {actual} bytes of tensor data, the header needs {end}")
    if actual > end:
        raise _fail(path, f"corrupted: {actual - end} unexpected trailing bytes")
    for name, spec in manifest["tensors"].items():
        found = h.entries.get(name)
        if found is None:
            raise _fail(path, f"corrupted: manifest names tensor '{name}', which the file lacks")
        if found["shape"] != spec["shape"] or found["dtype"] != spec["dtype"]:
            raise _fail(
                path,
                f"corrupted: tensor '{name}' is {found['dtype']}{found['shape']}, "
                f"the manifest says {spec['dtype']}{spec['shape']}",
            )
    extra = next((name for name in h.entries if name not in manifest["tensors"]), None)
    if extra is not None:
        raise _fail(path, f"corrupted: tensor '{extra}' is in the file but not in the manifest")
    token_entry = h.entries.get(TOKEN_IDS)
    if token_entry is None or token_entry["shape"] != [manifest["token_count"]]:
        raise _fail(path, f"corrupted: '{TOKEN_IDS}' tensor missing or not of length token_count")
    if token_entry["dtype"] not in TOKEN_ID_CODES:
        raise _fail(path, f"corrupted: '{TOKEN_IDS}' has dtype {token_entry['dtype']}, expected I64 or I32")


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    return read_header(path).manifest


def read_token_ids(path: str | os.PathLike[str], header: Header | None = None) -> list[int]:
    """The artifact's token ids, read without loading the cache tensors (no torch)."""
    h = header or read_header(path)
    entry = h.entries[TOKEN_IDS]
    start, end = entry["data_offsets"]
    with open(h.path, "rb") as fh:
        fh.seek(h.data_start + start)
        raw = fh.read(end - start)
    if len(raw) != end - start:
        raise _fail(h.path, "truncated while reading token ids")
    ids = array(TOKEN_ID_CODES[entry["dtype"]])
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    if ids and min(ids) < 0:
        raise _fail(h.path, f"corrupted: '{TOKEN_IDS}' holds a negative token id")
    return ids.tolist()


def check_hashes(header: Header) -> list[str]:
    """Re-hash every tensor the manifest lists; return the names whose digest differs.

    Streams the file through two small buffers (:mod:`kvcdn_core.artifact.stream_check`), so checking costs
    a few MiB of memory whatever the file's size; :func:`load_tensors` is the path that keeps the
    bytes.
    """
    from kvcdn_core.artifact import stream_check

    return stream_check.mismatched(header)


def load_tensors(
    header: Header, device: str = "cpu", verify_hashes: bool = True, direct: bool | None = None
) -> dict[str, Any]:
    """Read the whole data region once and return every tensor as a torch tensor.

    The tensors are views on one buffer laid out like the file, filled by one read (``O_DIRECT``
    when the file is cold, see :mod:`kvcdn_core.artifact.tensor_io`), and each tensor's digest is checked by
    worker threads while the read goes on. ``direct`` forces (True) or forbids (False) direct I/O.
    """
    from kvcdn_core.artifact import tensor_io

    reader = tensor_io.read_checked(header, verify_hashes=verify_hashes, direct=direct)
    tensors = {}
    for name in header.entries:
        t = tensor_io.as_tensor(reader, name)
        tensors[name] = t if device == "cpu" else t.to(device)
    return tensors


def tensor_bytes(t: Any) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, as stored in the file."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def write_artifact(path: str | os.PathLike[str], manifest: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """Write an artifact atomically: temporary file in the same directory, fsync, rename.

    ``tensors`` maps names to torch tensors and must include ``token_ids``. The manifest's
    ``tensors`` table (dtype, shape, digest) is filled in here.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if TOKEN_IDS not in tensors:
        raise ValueError("an artifact needs a token_ids tensor")
    manifest = dict(manifest)
    algorithm = digests.BY_FORMAT_VERSION[FORMAT_VERSION]
    table = {}
    prepared = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        prepared[name] = t
        table[name] = {
            "dtype": TORCH_TO_ST[str(t.dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            algorithm: digests.hexdigest(algorithm, tensor_bytes(t), threads=2),
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
