"""The server's own signed blob URLs (local storage): the PUT of an upload, the GET of an artifact.

No ``Authorization`` here: the signature over (op, artifact id, size, expiry) is the credential.
"""

from __future__ import annotations

import hashlib
import os

import blake3
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

import kvcdn_wire as wire
from kvcdn_core.store.record import HEX64
from kvcdn_server import chunks
from kvcdn_server.auth import Svc
from kvcdn_server.errors import ApiError, not_found
from kvcdn_server.rows import artifact_key
from kvcdn_server.validation import UUID
from kvcdn_wire import ErrorCode

router = APIRouter()

#: Bytes read and sent at a time by a GET of a blob or chunk. Larger blocks mean fewer thread hops and
#: socket writes per MB: on the benchmark's 2-core machine 4 MiB took 0.53-0.62 ms of the server's CPU
#: per MB against 0.67-0.90 ms for 1 MiB (benchmarks/object_get.py). A GET holds at most about two
#: blocks (the one being sent waits for the socket to drain).
BODY_BLOCK = 4 << 20


def _checked(s, op: str, artifact_id: str, request: Request) -> int:
    if not UUID.match(artifact_id):
        raise ApiError(403, ErrorCode.INVALID_SIGNATURE, "the URL is not a valid signed URL")
    return s.signer.check(op, artifact_id, request.query_params)


async def _receive(request: Request, size: int, target, hasher) -> int:
    """Stream the body into ``target``, hashing it with ``hasher``: 413 past the signed ``size``
    (declared or sent), 422 when it ends short. Returns the bytes written."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > size:
        raise ApiError(413, ErrorCode.PAYLOAD_TOO_LARGE, f"the body is larger than the signed {size} bytes")
    written = 0
    with open(target, "wb") as out:
        async for block in request.stream():
            written += len(block)
            if written > size:
                raise ApiError(413, ErrorCode.PAYLOAD_TOO_LARGE, f"the body is larger than the signed {size} bytes")
            hasher.update(block)
            await run_in_threadpool(out.write, block)
        if written != size:
            raise ApiError(422, ErrorCode.SIZE_MISMATCH, f"received {written} bytes, the URL is for {size}")
        out.flush()
        await run_in_threadpool(os.fsync, out.fileno())
    return written


@router.put(wire.BLOB)
async def blob_put(artifact_id: str, request: Request, s: Svc):
    size = _checked(s, "put", artifact_id, request)
    digest = hashlib.sha256()
    receiving = s.store.receiving(artifact_id)  # one PUT at a time per upload (409 otherwise)
    target = await run_in_threadpool(receiving.__enter__)
    try:
        written = await _receive(request, size, target, digest)
    except BaseException as exc:
        await run_in_threadpool(receiving.__exit__, type(exc), exc, exc.__traceback__)
        raise
    await run_in_threadpool(receiving.__exit__, None, None, None)
    etag = f'"{digest.hexdigest()}"'
    return JSONResponse({"size_bytes": written, "sha256": digest.hexdigest()}, headers={"ETag": etag})


@router.get(wire.BLOB)
def blob_get(artifact_id: str, request: Request, s: Svc):
    _checked(s, "get", artifact_id, request)
    row = s.store.ready_row(artifact_id)
    if row is None:
        raise not_found()
    headers = {"ETag": f'"{row.sha256}"', "Cache-Control": "private, no-store", "Content-Length": str(row.size_bytes)}
    if row.record is not None:  # a chunked artifact: the whole `.kv` file, rebuilt from its chunks
        copy = s.store.objects.rebuilt(row)
        path = copy.__enter__()
        try:
            body = open(path, "rb")
        except BaseException as exc:
            copy.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return StreamingResponse(_stream(body, copy), media_type="application/octet-stream", headers=headers)
    return StreamingResponse(
        _stream(s.storage.open_read(artifact_key(artifact_id))), media_type="application/octet-stream", headers=headers
    )


def _stream(body, owner=None):
    try:
        while block := body.read(BODY_BLOCK):
            yield block
    finally:
        body.close()
        if owner is not None:
            owner.__exit__(None, None, None)


def _chunk_checked(s, op: str, digest: str, request: Request) -> int:
    if not HEX64.fullmatch(digest):
        raise ApiError(403, ErrorCode.INVALID_SIGNATURE, "the URL is not a valid signed URL")
    return s.signer.check(op, f"chunks/{digest}", request.query_params)


@router.put(wire.BLOB_CHUNK)
async def chunk_put(digest: str, request: Request, s: Svc):
    """One chunk object: its bytes must hash (BLAKE3) to the digest its URL names, and have the
    signed size; stored once for all tenants (kvcdn_server.chunks)."""
    size = _chunk_checked(s, "put", digest, request)
    hasher = blake3.blake3()
    temp = s.store.objects.temp_file()
    target = temp.__enter__()
    try:
        written = await _receive(request, size, target, hasher)
        if hasher.hexdigest() != digest:
            raise ApiError(422, ErrorCode.DIGEST_MISMATCH, "the bytes do not hash to the object's digest")
        await run_in_threadpool(s.store.objects.accept, digest, size, target)
    finally:
        temp.__exit__(None, None, None)
    return JSONResponse({"size_bytes": written, "digest": digest}, headers={"ETag": f'"{digest}"'})


@router.get(wire.BLOB_CHUNK)
def chunk_get(digest: str, request: Request, s: Svc):
    size = _chunk_checked(s, "get", digest, request)
    if s.storage.size_of(chunks.object_key(digest)) != size:
        raise not_found()
    headers = {"ETag": f'"{digest}"', "Cache-Control": "private, no-store", "Content-Length": str(size)}
    return StreamingResponse(
        _stream(s.storage.open_read(chunks.object_key(digest))), media_type="application/octet-stream", headers=headers
    )
