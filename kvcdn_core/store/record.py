"""The artifact record: what a chunk store keeps of one artifact besides its chunks' bytes.

A record is small JSON (``artifacts/<name>.json``): the `.kv` file's header bytes exactly, and the
list of chunks and the tail that rebuild its data region (docs/store.md). It is outside input (any
writer of the store, or a corrupted object), so :meth:`ArtifactRecord.from_json` checks every field
and its consistency with the header before anything trusts it, and refuses with one line. Pure
Python: no numpy, no torch (``kvcdn store ls`` reads records only).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from kvcdn_core import artifact
from kvcdn_core.errors import ArtifactError

FORMAT = "kvcdn-chunked"
#: Version 2 records may hold chunks made of pieces; a record without any is still written as
#: version 1, so a kvcdn that predates pieces reads it, and refuses a version 2 one by its version.
VERSION = 2
READS = (1, 2)
#: Largest record accepted: the header (at most artifact.MAX_HEADER_BYTES) plus about 250 bytes per
#: chunk, so a million-token artifact's record stays well under it.
MAX_RECORD_BYTES = artifact.MAX_HEADER_BYTES + (8 << 20)
#: Artifact names: safe as one storage key segment and on every file system; no leading dot
#: (listings skip dot files, temporary files start with one).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
HEX64 = re.compile(r"[0-9a-f]{64}")
MODEL_KEYS = ("architecture", "config_sha256", "tokenizer_sha256", "weights_sha256", "id")
_KEYS = {
    "format",
    "version",
    "name",
    "size",
    "header",
    "root",
    "chunk_tokens",
    "token_count",
    "reuse",
    "model",
    "chunked",
    "chunks",
    "tail",
}


@dataclasses.dataclass(frozen=True)
class PieceRef:
    """One stored object holding a run of a chunk's tokens: every chunked tensor's rows for them,
    in file order (a whole chunk is the one-piece case)."""

    digest: str
    tokens: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    """One chunk of a record: its chain key (which tokens), content digest (which bytes), size.

    A chunk made of ``pieces`` (a stored shorter chunk that is a token-prefix of it, then the rest)
    has no digest of its own: its pieces tile its tokens, in order.
    """

    key: str
    digest: str | None
    tokens: int
    bytes: int
    pieces: tuple[PieceRef, ...] = ()

    @property
    def parts(self) -> tuple[PieceRef, ...]:
        """The objects that hold the chunk, in token order: its pieces, or itself whole."""
        if self.pieces:
            return self.pieces
        assert self.digest is not None
        return (PieceRef(self.digest, self.tokens, self.bytes),)

    def to_dict(self) -> dict[str, Any]:
        if not self.pieces:
            return {"key": self.key, "digest": self.digest, "tokens": self.tokens, "bytes": self.bytes}
        pieces = [dataclasses.asdict(p) for p in self.pieces]
        return {"key": self.key, "tokens": self.tokens, "bytes": self.bytes, "pieces": pieces}


@dataclasses.dataclass(frozen=True)
class TailRef:
    """Every tensor not cut into chunks, concatenated in file order, stored as one object."""

    digest: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class ArtifactRecord:
    name: str
    size: int
    header: str
    root: str
    chunk_tokens: int
    token_count: int
    reuse: str
    model: dict[str, str | None]
    chunked: tuple[str, ...]
    chunks: tuple[ChunkRef, ...]
    tail: TailRef | None
    format: str = FORMAT
    version: int = VERSION

    # -- derived -----------------------------------------------------------------------------------

    @property
    def digests(self) -> list[str]:
        """Every object the record references (chunks' pieces, then the tail), in order, repeats kept."""
        found = [p.digest for c in self.chunks for p in c.parts]
        return found + ([self.tail.digest] if self.tail else [])

    @property
    def stored_bytes(self) -> int:
        """Bytes of the chunks and the tail (the data region, without the header)."""
        return sum(c.bytes for c in self.chunks) + (self.tail.bytes if self.tail else 0)

    def parsed_header(self) -> artifact.Header:
        """The `.kv` header, validated by the artifact reader for a file of :attr:`size` bytes.
        Parsed once per record and kept (:meth:`from_json` keeps the one it checked): the engine's
        scheduler reads it twice per request after the lookup. Callers only read it."""
        kept = self.__dict__.get("_header")
        if kept is None:
            kept = artifact.parse_header(self._header_path, self.header.encode("utf-8"), self.size)
            object.__setattr__(self, "_header", kept)
        return kept

    @property
    def _header_path(self) -> Any:  # what parse_header names the header by in its messages (a str here)
        return f"record '{self.name}'"

    # -- JSON --------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "version": self.version,
            "name": self.name,
            "size": self.size,
            "header": self.header,
            "root": self.root,
            "chunk_tokens": self.chunk_tokens,
            "token_count": self.token_count,
            "reuse": self.reuse,
            "model": dict(self.model),
            "chunked": list(self.chunked),
            "chunks": [c.to_dict() for c in self.chunks],
            "tail": dataclasses.asdict(self.tail) if self.tail else None,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str = "record") -> ArtifactRecord:
        """Parse and check a record; :class:`ArtifactError` (one line) for anything malformed."""
        if not isinstance(data, (bytes, bytearray)):
            raise ArtifactError(f"{where}: corrupted: not bytes")
        if len(data) > MAX_RECORD_BYTES:
            raise ArtifactError(f"{where}: refused: {len(data)} bytes is over the record limit")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise ArtifactError(f"{where}: corrupted: not UTF-8") from None
        value = artifact._parse_json(where, text, "record")
        record = _from_value(where, value)
        header = _check_against_header(where, record)
        object.__setattr__(record, "_header", dataclasses.replace(header, path=record._header_path))
        return record

    @classmethod
    def from_checked(cls, text: str, where: str = "record") -> ArtifactRecord:
        """A record that :meth:`from_json` checked and :meth:`to_json` wrote where only this program
        writes (the hosted server's own rows), read back: its fields are checked again, cheaply,
        but not its header, which was parsed and matched against its chunk plan before it was kept
        and is the costly part (a prefix lookup's grant reads one record per request)."""
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ArtifactError(f"{where}: corrupted: not valid JSON ({exc})") from None
        return _from_value(where, value)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _from_value(where: str, value: Any) -> ArtifactRecord:
    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{where}: corrupted: {what}")

    expect(isinstance(value, dict), "not a JSON object")
    expect(value.get("format") == FORMAT, f"format is not {FORMAT!r}")
    version = value.get("version")
    if type(version) is not int or version not in READS:
        raise ArtifactError(f"{where}: record version {version!r} is not one this kvcdn reads (1, 2)")
    unknown = sorted(set(value) - _KEYS)
    expect(not unknown, f"unknown field {unknown[0] if unknown else ''!r}")
    missing = sorted(_KEYS - set(value))
    expect(not missing, f"lacks {', '.join(missing)}")
    name = value["name"]
    expect(isinstance(name, str) and NAME.fullmatch(name) is not None, "name is not a valid artifact name")
    expect(_count(value["size"]), "size is not a non-negative integer")
    expect(isinstance(value["header"], str), "header is not a string")
    expect(isinstance(value["root"], str) and HEX64.fullmatch(value["root"]) is not None, "root is not a key")
    expect(_count(value["chunk_tokens"]) and value["chunk_tokens"] > 0, "chunk_tokens is not a positive integer")
    expect(_count(value["token_count"]), "token_count is not a non-negative integer")
    expect(value["reuse"] in ("any_prefix", "whole_prefix"), "reuse is not any_prefix or whole_prefix")
    model = value["model"]
    expect(
        isinstance(model, dict)
        and set(model) <= set(MODEL_KEYS)
        and all(v is None or isinstance(v, str) for v in model.values()),
        "model is not an object of strings",
    )
    chunked = value["chunked"]
    expect(
        isinstance(chunked, list) and all(isinstance(n, str) for n in chunked) and len(set(chunked)) == len(chunked),
        "chunked is not a list of distinct tensor names",
    )
    chunks = value["chunks"]
    expect(isinstance(chunks, list), "chunks is not a list")
    refs = []
    for i, c in enumerate(chunks):
        pieced = version >= 2 and isinstance(c, dict) and "pieces" in c
        fields = {"key", "tokens", "bytes", "pieces"} if pieced else {"key", "digest", "tokens", "bytes"}
        expect(
            isinstance(c, dict)
            and set(c) == fields
            and isinstance(c["key"], str)
            and HEX64.fullmatch(c["key"]) is not None
            and (pieced or _is_digest(c["digest"]))
            and _count(c["tokens"])
            and _count(c["bytes"]),
            f"chunk {i} is not {{key, digest, tokens, bytes}} or {{key, tokens, bytes, pieces}}",
        )
        pieces: list[PieceRef] = []
        if pieced:
            expect(
                isinstance(c["pieces"], list)
                and len(c["pieces"]) >= 2
                and all(
                    isinstance(p, dict)
                    and set(p) == {"digest", "tokens", "bytes"}
                    and _is_digest(p["digest"])
                    and _count(p["tokens"])
                    and p["tokens"] > 0
                    and _count(p["bytes"])
                    for p in c["pieces"]
                ),
                f"chunk {i}'s pieces are not a list of two or more {{digest, tokens, bytes}}",
            )
            pieces = [PieceRef(p["digest"], p["tokens"], p["bytes"]) for p in c["pieces"]]
            expect(sum(p.tokens for p in pieces) == c["tokens"], f"chunk {i}'s pieces do not tile its tokens")
        refs.append(ChunkRef(c["key"], None if pieced else c["digest"], c["tokens"], c["bytes"], tuple(pieces)))
    tail = value["tail"]
    expect(
        tail is None
        or (
            isinstance(tail, dict)
            and set(tail) == {"digest", "bytes"}
            and isinstance(tail["digest"], str)
            and HEX64.fullmatch(tail["digest"]) is not None
            and _count(tail["bytes"])
        ),
        "tail is neither null nor {digest, bytes}",
    )
    return ArtifactRecord(
        name=name,
        size=value["size"],
        header=value["header"],
        root=value["root"],
        chunk_tokens=value["chunk_tokens"],
        token_count=value["token_count"],
        reuse=value["reuse"],
        model=dict(model),
        chunked=tuple(chunked),
        chunks=tuple(refs),
        tail=TailRef(tail["digest"], tail["bytes"]) if tail else None,
        version=version,
    )


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and HEX64.fullmatch(value) is not None


def token_bytes(header: artifact.Header, name: str) -> tuple[int, int]:
    """``(outer, inner)`` of a chunked tensor: it is ``outer`` runs of ``tokens`` rows of ``inner``
    bytes (shape ``[..., tokens, last]``)."""
    entry = header.entries[name]
    shape = entry["shape"]
    return math.prod(shape[:-2]), shape[-1] * artifact.DTYPES[entry["dtype"]][0]


def _check_against_header(where: str, record: ArtifactRecord) -> artifact.Header:
    """The record's chunk plan must be the one its header implies: the rebuild writes by it.
    Returns the header, parsed."""

    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{where}: corrupted: {what}")

    raw = record.header.encode("utf-8")
    header = artifact.parse_header(where, raw, record.size)
    expect(header.data_start == 8 + len(raw), "header length does not match the file")
    expect(record.token_count == header.token_count, "token_count differs from the header's")
    from kvcdn_core.artifact.manifest import manifest_of

    manifest = manifest_of(header)
    expect(record.model == {k: getattr(manifest.model, k) for k in MODEL_KEYS}, "model differs from the header's")
    expect(record.reuse == manifest.reuse, "reuse differs from the header's")
    for name in record.chunked:
        entry = header.entries.get(name)
        expect(
            entry is not None and len(entry["shape"]) >= 2 and entry["shape"][-2] == record.token_count,
            f"chunked tensor {name!r} is not a [..., tokens, inner] tensor of the header",
        )
    offsets = [header.entries[n]["data_offsets"][0] for n in record.chunked]
    expect(offsets == sorted(offsets), "chunked tensors are not in file order")
    per_token = sum(math.prod(token_bytes(header, n)) for n in record.chunked)
    if record.chunked and record.token_count:
        full, rest = divmod(record.token_count, record.chunk_tokens)
        want = [record.chunk_tokens] * full + ([rest] if rest else [])
        expect([c.tokens for c in record.chunks] == want, "chunks do not cut token_count by chunk_tokens")
        expect(all(c.bytes == c.tokens * per_token for c in record.chunks), "a chunk's size is not its tokens' bytes")
        expect(
            all(p.bytes == p.tokens * per_token for c in record.chunks for p in c.pieces),
            "a piece's size is not its tokens' bytes",
        )
    else:
        expect(not record.chunks, "chunks listed for an artifact without chunked tensors")
    data = header.file_size - header.data_start
    chunked_bytes = per_token * record.token_count if record.chunks else 0
    tail_bytes = data - chunked_bytes
    expect(
        (record.tail.bytes if record.tail else 0) == tail_bytes and (record.tail is not None or tail_bytes == 0),
        f"tail is not the {tail_bytes} bytes the chunks leave",
    )
    return header
