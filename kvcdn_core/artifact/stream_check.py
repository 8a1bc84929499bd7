"""Checking an artifact's tensor digests in bounded memory, whatever the file's size.

A load for inference needs every byte in memory anyway, so :mod:`kvcdn_core.artifact.tensor_io` reads the
whole file into one buffer and hashes on the way. A check keeps nothing: the hosted server checks
uploads of tens of gigabytes at confirm, several at once, and ``inspect --check`` runs on any file.
So here the data region is read front to back in :data:`CHUNK` pieces into two reused buffers (the
next piece is read while this one is hashed) and each tensor is hashed incrementally as its bytes
pass: a check holds ``2 × CHUNK`` of file bytes, for a file of any size.

Pure Python: no numpy or torch, so ``inspect --check`` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from concurrent.futures import Future

from kvcdn_core.artifact import digests
from kvcdn_core.cores import hash_workers, shared_pool
from kvcdn_core.errors import ArtifactError

#: Bytes read at a time. Large enough that a read call and a BLAKE3 update spread over the cores
#: cost little per byte; two of them are what a check holds.
CHUNK = 4 << 20


def mismatched(header) -> list[str]:
    """Names of the tensors whose bytes do not hash to the manifest's digest (file order)."""
    algorithm = header.digest
    expected = header.manifest["tensors"]
    threads = hash_workers()
    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], name) for name, entry in header.entries.items())
    bad = []
    try:
        fd = os.open(header.path, os.O_RDONLY)
    except OSError as exc:
        raise ArtifactError(f"{header.path}: cannot read: {exc.strerror or exc}") from None
    try:
        chunks = _chunks(fd, header.path, header.data_start, header.file_size)
        try:
            piece = memoryview(b"")
            for start, end, name in spans:  # the spans tile the data region (read_header checked)
                digest = digests.hasher(algorithm, threads)
                need = end - start
                while need:
                    if not piece:
                        piece = next(chunks)
                    take = min(need, len(piece))
                    digest.update(piece[:take])
                    piece, need = piece[take:], need - take
                if digest.hexdigest() != expected[name].get(algorithm):
                    bad.append(name)
        finally:
            chunks.close()  # waits for a read still in flight: none may outlive the descriptor
    finally:
        os.close(fd)
    return bad


def _chunks(fd: int, path, offset: int, stop: int) -> Generator[memoryview, None, None]:
    """The file's bytes ``[offset, stop)`` as successive views on two alternating buffers; the read
    of the next piece runs (on the reader pool) while the caller hashes the one yielded."""
    from kvcdn_core.artifact.tensor_io import READERS

    pool = shared_pool("read", READERS)
    buffers = [bytearray(min(CHUNK, max(stop - offset, 1))) for _ in range(2)]
    ahead: Future | None = None

    def read(index: int, at: int) -> memoryview:
        view = memoryview(buffers[index])[: min(len(buffers[index]), stop - at)]
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], at + done)
            except OSError as exc:
                raise ArtifactError(f"{path}: cannot read: {exc.strerror or exc}") from None
            if n <= 0:
                raise ArtifactError(f"{path}: truncated while reading tensor data")
            done += n
        return view

    try:
        index = 0
        if offset < stop:
            ahead = pool.submit(read, index, offset)
        while ahead is not None:
            view = ahead.result()
            offset += len(view)
            ahead = pool.submit(read, 1 - index, offset) if offset < stop else None
            yield view
            index = 1 - index
    finally:
        if ahead is not None:
            ahead.cancel() or ahead.exception()
