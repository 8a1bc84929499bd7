"""Cutting a `.kv` file into token chunks and a tail, and rebuilding the file byte for byte.

Which tensors are cut (docs/store.md): those of layers whose cache crops to any prefix
(:data:`kvcdn_core.artifact.CROPPABLE_KINDS`), shaped ``[..., tokens, inner]`` with ``tokens`` the
artifact's token count, in an artifact without quantization. Chunk ``i`` holds, for each of them
in file order, the C-order bytes of its slice ``[..., i*C:(i+1)*C, :]``. Everything else (token
ids, sliding windows, recurrent and linear-attention states, a quantized artifact's parts) is the
*tail*: those tensors' bytes concatenated in file order. The header is kept verbatim in the record,
so the rebuilt file is the same bytes, whichever format version wrote it.

A chunk may instead be made of *pieces* (:meth:`Cutter.plan`): runs of its tokens, each an object of
the same layout (every chunked tensor's rows for those tokens, in file order). A put uses them to
reference a stored shorter chunk that is a token-prefix of its own (the last, partial chunk of an
earlier turn of a conversation) and store only the rest; the stored bytes are compared by digest.

numpy views over a memory map of the file (:func:`mapped`): one chunk's bytes are gathered at a time.
No torch.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TypeVar

import blake3
import numpy as np

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import Manifest, manifest_of
from kvcdn_core.atomic import atomic_path
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.store import keys
from kvcdn_core.store.record import MODEL_KEYS, VERSION, ArtifactRecord, ChunkRef, PieceRef, TailRef, token_bytes

#: an object's bytes, read or mapped
Bytes = TypeVar("Bytes", bound=bytes | memoryview)


def digest_of(data: bytes | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


def mapped(path: str | os.PathLike[str]) -> np.ndarray:
    """A file's bytes as a read-only array over a memory map: never read whole into memory.

    A plain array over :mod:`mmap`, not ``np.memmap``: every slice of an ``np.memmap`` runs Python
    code to make another ``np.memmap``, and a put slices every tensor of every chunk (on a thread
    that shares Python's lock with a vLLM engine, that Python work is what costs).
    """
    with open(path, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(view, dtype=np.uint8)


def chunked_names(header: artifact.Header) -> list[str]:
    """The tensors cut into chunks, in the order of their bytes in the file (see the module doc)."""
    manifest = manifest_of(header)
    if manifest.quantization:
        return []
    tokens = header.token_count
    names: set[str] = set()
    for layer in manifest.layers:
        if not layer.croppable:
            continue
        for name in layer.tensors.values():
            shape = header.entries[name]["shape"]
            if len(shape) >= 2 and shape[-2] == tokens:
                names.add(name)
    return sorted(names, key=lambda n: header.entries[n]["data_offsets"][0])


def tail_names(header: artifact.Header, chunked: list[str] | tuple[str, ...]) -> list[str]:
    skip = set(chunked)
    names = [n for n in header.entries if n not in skip]
    return sorted(names, key=lambda n: header.entries[n]["data_offsets"][0])


def header_text(path: Path, header: artifact.Header) -> str:
    """The header's bytes exactly (padding spaces kept), as text: it is UTF-8 JSON."""
    with open(path, "rb") as fh:
        fh.seek(8)
        raw = fh.read(header.data_start - 8)
    return raw.decode("utf-8")


def root_of(manifest: Manifest, chunk_tokens: int = keys.CHUNK_TOKENS) -> str:
    """The root key of an artifact's chains: its model fingerprint, representation and chunk size."""
    rep = keys.representation(manifest.compute_dtype, manifest.quantization)
    return keys.root_key(dataclasses.asdict(manifest.model), rep, chunk_tokens)


@dataclasses.dataclass
class Blob:
    """One object a put references: a whole chunk, a piece of one (``chunk``: its index), or the
    tail (``chunk`` None), with the function that gathers its bytes (again) when wanted."""

    digest: str
    size: int
    chunk: int | None
    gather: Callable[[], bytes]


@dataclasses.dataclass
class Plan:
    """What a put writes: the record's chunks and tail, and every object they reference."""

    chunks: list[ChunkRef]
    tail: TailRef | None
    blobs: list[Blob]


class Cutter:
    """The chunks and tail of one `.kv` file, gathered on demand from a read-only memory map."""

    def __init__(self, header: artifact.Header, token_ids: list[int], chunk_tokens: int = keys.CHUNK_TOKENS):
        self.header = header
        self.chunk_tokens = chunk_tokens
        self.chunked = chunked_names(header)
        self.tail = tail_names(header, self.chunked)
        self.data = mapped(header.path)
        self.root = root_of(manifest_of(header), chunk_tokens)
        tokens = header.token_count
        self.chain = keys.chain(self.root, token_ids, chunk_tokens) if self.chunked and tokens else []
        self.bounds = [(start, min(start + chunk_tokens, tokens)) for start in range(0, tokens, chunk_tokens)]
        if not self.chain:
            self.bounds = []

    def check_digests(self) -> None:
        """Every tensor's bytes against its manifest digest, read through the memory map (the file
        is never copied whole into memory); :class:`ArtifactError` naming the first mismatch."""
        from kvcdn_core.artifact import digests

        h = self.header
        bad = []
        for name, spec in h.manifest["tensors"].items():
            start, end = h.entries[name]["data_offsets"]
            view = self.data[h.data_start + start : h.data_start + end]
            if digests.hexdigest(h.digest, view, threads=2) != spec[h.digest]:
                bad.append(name)
        if bad:
            raise ArtifactError(f"{h.path}: corrupted: {h.digest} mismatch in {len(bad)} tensor(s), first '{bad[0]}'")

    def _tensor(self, name: str) -> np.ndarray:
        start, end = self.header.entries[name]["data_offsets"]
        outer, inner = token_bytes(self.header, name)
        base = self.header.data_start
        return self.data[base + start : base + end].reshape(outer, self.header.token_count, inner)

    def rows(self, t0: int, t1: int) -> bytes:
        """The bytes of tokens ``[t0, t1)``: each chunked tensor's slice of them, in file order (a
        chunk's layout; a piece's too)."""
        return b"".join(self._tensor(name)[:, t0:t1, :].tobytes() for name in self.chunked)

    def chunk(self, i: int) -> bytes:
        """Chunk ``i``'s bytes."""
        return self.rows(*self.bounds[i])

    def tail_bytes(self) -> bytes:
        base = self.header.data_start
        spans = [self.header.entries[n]["data_offsets"] for n in self.tail]
        return b"".join(self.data[base + a : base + b].tobytes() for a, b in spans)

    def plan(
        self, candidates: dict[int, tuple[PieceRef, ...]], present: Callable[[str], bool], settled: int | None = None
    ) -> Plan:
        """Each chunk whole, or as stored pieces plus the rest, and the tail; every byte read and
        hashed once, a chunk with a rest piece twice.

        ``candidates[i]`` are the pieces of a stored chunk whose tokens start where chunk ``i``
        does (a shorter artifact of the same chain: its last, partial chunk). The longest run of
        leading candidates whose bytes are this file's rows for their tokens (their digests are
        compared: exact) is referenced, and only the rest becomes a new piece. Nothing matches: the
        chunk is whole. The chunk's whole digest is computed only for a chunk with a rest piece (a
        turn's last chunk, about once a put): when the store holds those whole bytes already (under
        another artifact, or left by a deleted one), the chunk references them and stores no rest.

        ``settled``: the last chunk's new bytes (its rest, or the chunk when nothing was reused) are
        cut into two pieces at that token when it falls inside them, unless the store holds the
        chunk's whole bytes; the rows past it may differ in a longer artifact, the rows before it
        then still match a piece of their own.
        """
        chunks: list[ChunkRef] = []
        blobs: list[Blob] = []

        def blob(data: bytes, chunk: int | None, gather: Callable[[], bytes]) -> Blob:
            return Blob(digest_of(data), len(data), chunk, gather)

        for i, key in enumerate(self.chain):
            t0, t1 = self.bounds[i]
            pieces, rest = self._reused(t0, t1, candidates.get(i, ()), i, blob)
            whole = None
            if rest:  # where this chunk's new bytes start: its rest piece, the chunk, or none
                new_from = t1 - pieces[-1][0].tokens
            else:
                new_from = t1 if pieces else t0
            cut = settled is not None and i == len(self.chain) - 1 and new_from < settled < t1
            if rest or cut:  # new bytes, unless the store holds the whole chunk already
                whole = blob(self.chunk(i), i, functools.partial(self.chunk, i))
                if present(whole.digest):
                    pieces, cut = [], False
            if cut:
                assert settled is not None
                pieces = pieces[:-1] if rest else []
                for a, b in ((new_from, settled), (settled, t1)):
                    got = blob(self.rows(a, b), i, functools.partial(self.rows, a, b))
                    pieces.append((PieceRef(got.digest, b - a, got.size), got))
            if len(pieces) > 1:
                chunks.append(ChunkRef(key, None, t1 - t0, sum(b.size for _, b in pieces), tuple(p for p, _ in pieces)))
                blobs += [b for _, b in pieces]
                continue
            # one stored piece that is the whole chunk: its bytes are the chunk's, already hashed
            if whole is None:
                whole = pieces[0][1] if pieces else blob(self.chunk(i), i, functools.partial(self.chunk, i))
            chunks.append(ChunkRef(key, whole.digest, t1 - t0, whole.size))
            blobs.append(whole)
        tail = None
        if self.tail:
            tail_blob = blob(self.tail_bytes(), None, self.tail_bytes)
            tail = TailRef(tail_blob.digest, tail_blob.size)
            blobs.append(tail_blob)
        return Plan(chunks, tail, blobs)

    def _reused(
        self, t0: int, t1: int, candidates: tuple[PieceRef, ...], chunk: int, blob: Callable[..., Blob]
    ) -> tuple[list[tuple[PieceRef, Blob]], bool]:
        """Chunk ``[t0, t1)`` as stored pieces and a rest, or ``[]`` (store it whole); a single
        piece when one stored piece is the whole chunk. True when the last piece is the rest (not
        a stored candidate)."""
        if not candidates or (len(candidates) == 1 and candidates[0].tokens >= t1 - t0):
            return [], False
        found: list[tuple[PieceRef, Blob]] = []
        start = t0
        for piece in candidates:
            end = start + piece.tokens
            if end > t1:
                break
            got = blob(self.rows(start, end), chunk, functools.partial(self.rows, start, end))
            if got.digest != piece.digest:
                if start == t0 and end == t1:  # not that piece, but these are the chunk's bytes
                    return [(PieceRef(got.digest, end - start, got.size), got)], False
                break
            found.append((PieceRef(piece.digest, piece.tokens, got.size), got))
            start = end
        if not found:
            return [], False
        if start == t1:
            return found, False
        rest = blob(self.rows(start, t1), chunk, functools.partial(self.rows, start, t1))
        return found + [(PieceRef(rest.digest, t1 - start, rest.size), rest)], True


def record_for(name: str, path: Path, header: artifact.Header, cutter: Cutter, plan: Plan) -> ArtifactRecord:
    """The record of a packed file, from its cutter and plan (version 1 unless a chunk has pieces)."""
    manifest = manifest_of(header)
    return ArtifactRecord(
        name=name,
        size=header.file_size,
        header=header_text(path, header),
        root=cutter.root,
        chunk_tokens=cutter.chunk_tokens,
        token_count=header.token_count,
        reuse=manifest.reuse,
        model={k: getattr(manifest.model, k) for k in MODEL_KEYS},
        chunked=tuple(cutter.chunked),
        chunks=tuple(plan.chunks),
        tail=plan.tail,
        version=VERSION if any(c.pieces for c in plan.chunks) else 1,
    )


def checked(data: Bytes | None, digest: str, size: int, where: str) -> Bytes:
    """``data`` when it is the object named ``digest`` (BLAKE3) of ``size`` bytes; else one line."""
    if data is None:
        raise ArtifactError(f"{where}: chunk {digest} is missing from the store (run kvcdn store check)")
    if len(data) != size or digest_of(data) != digest:
        raise ArtifactError(f"{where}: chunk {digest} is corrupted (its bytes do not hash to its name)")
    return data


#: bytes a :func:`read_into` that reports progress reads at a time (about a layer of a SmolLM2 chunk)
LANDED_STEP = 256 << 10


def read_into(
    source: IO[bytes] | Iterable[bytes], into: memoryview, landed: Callable[[int], None] | None = None
) -> bytes | memoryview:
    """An object's bytes read into ``into`` (memory the caller chose: already touched), a stream
    through ``readinto`` or an iterable of pieces copied one by one; ``into`` itself when the object
    is exactly that size. Otherwise the bytes as they came, which :func:`checked` then refuses in
    one line: a short or long object is never cut or padded to look right.

    ``landed(n)`` is told, as the bytes arrive, that the first ``n`` of ``into`` are in place (a
    stream is then read :data:`LANDED_STEP` bytes at a time): a reader may use the front of an
    object before its end arrives (the vLLM connector copies a chunk's first layers meanwhile)."""
    size, got = len(into), 0
    step = LANDED_STEP if landed is not None else size
    if hasattr(source, "readinto"):
        stream: IO[bytes] = source  # type: ignore[assignment]
        while got < size and (n := stream.readinto(into[got : got + step])):  # type: ignore[attr-defined]
            got += n
            if landed is not None:
                landed(got)
        rest = stream.read() if got == size else b""
    else:
        read = getattr(source, "read", None)  # a stream without readinto: pieces of 1 MiB
        pieces = iter(functools.partial(read, 1 << 20), b"") if read is not None else iter(source)
        rest = b""
        for piece in pieces:
            take = min(len(piece), size - got)
            into[got : got + take] = memoryview(piece)[:take]
            got += take
            if take < len(piece):
                rest = piece[take:] + b"".join(pieces)
                break
            if landed is not None:
                landed(got)
    if got == size and not rest:
        return into
    return bytes(into[:got]) + rest


def rebuild(record: ArtifactRecord, fetch: Callable[[str, int], bytes | memoryview], target: Path) -> int:
    """Write the `.kv` file of ``record`` to ``target`` atomically; return the bytes fetched.

    ``fetch(digest, size)`` returns an object's bytes checked against its digest
    (:func:`checked`); one chunk (or piece of one) is held at a time and written in place.
    """
    header = record.parsed_header()
    raw = record.header.encode("utf-8")
    chunked = list(record.chunked)
    tail = tail_names(header, chunked)
    fetched = 0
    target = Path(target)
    try:
        with atomic_path(target) as tmp:
            with open(tmp, "r+b") as fh:
                fh.truncate(record.size)
            out = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(record.size,))
            out[:8] = np.frombuffer(struct.pack("<Q", len(raw)), dtype=np.uint8)
            out[8 : header.data_start] = np.frombuffer(raw, dtype=np.uint8)
            base, tokens = header.data_start, record.token_count
            views = {}
            for name in chunked:
                start, end = header.entries[name]["data_offsets"]
                outer, inner = token_bytes(header, name)
                views[name] = out[base + start : base + end].reshape(outer, tokens, inner)
            t0 = 0
            for ref in (p for c in record.chunks for p in c.parts):
                data = fetch(ref.digest, ref.bytes)
                fetched += len(data)
                offset = 0
                for name in chunked:
                    view = views[name]
                    count = view.shape[0] * ref.tokens * view.shape[2]
                    piece = np.frombuffer(data, dtype=np.uint8, count=count, offset=offset)
                    view[:, t0 : t0 + ref.tokens, :] = piece.reshape(view.shape[0], ref.tokens, view.shape[2])
                    offset += count
                t0 += ref.tokens
                del data
            if record.tail is not None:
                data = fetch(record.tail.digest, record.tail.bytes)
                fetched += len(data)
                offset = 0
                for name in tail:
                    start, end = header.entries[name]["data_offsets"]
                    out[base + start : base + end] = np.frombuffer(
                        data, dtype=np.uint8, count=end - start, offset=offset
                    )
                    offset += end - start
                del data
            out.flush()
            del views, out
    except OSError as exc:
        raise KvcdnError(f"cannot write '{target}': {exc.strerror or exc}") from None
    return fetched


def file_stem(path: str | os.PathLike[str]) -> str:
    return Path(path).name.removesuffix(".kv") or Path(path).name
