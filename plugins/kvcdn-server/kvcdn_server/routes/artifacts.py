"""Artifact routes: upload-url, confirm, list, get, download-url, delete, infer."""

from __future__ import annotations

import json

import sqlalchemy as sa
from anyio import from_thread
from fastapi import APIRouter, Request, Response

import kvcdn_wire as wire
from kvcdn_core import DEFAULT_COMPOSE_RULE, DEFAULT_RECOMPUTE
from kvcdn_server import chunks
from kvcdn_server.auth import Auth, Identity, MaybeAuth, Svc
from kvcdn_server.errors import not_found, validation
from kvcdn_server.inference import Composing
from kvcdn_server.rows import artifact_key, now_iso, upload_key, view
from kvcdn_server.services import Services
from kvcdn_server.validation import UUID, check_hint, check_id, check_name, check_prefix_filter
from kvcdn_wire.requests import ChunkedUploadRequest, ConfirmRequest, InferRequest, UploadUrlRequest
from kvcdn_wire.responses import (
    ArtifactPage,
    ArtifactRecord,
    ChunkedUploadGrant,
    ChunksGrant,
    DownloadGrant,
    InferAnswer,
    UploadGrant,
)

router = APIRouter()


@router.post(wire.UPLOAD_URL, response_model=UploadGrant)
def upload_url(identity: Auth, body: UploadUrlRequest, s: Svc):
    try:
        name, sha256, hints = body.resolved()
    except ValueError as exc:
        raise validation(str(exc)) from None
    name = check_name(name)
    for field, value in hints.items():
        check_hint(field, value)
    record = s.store.begin_upload(identity.tenant, name, body.size_bytes, sha256, body.visibility, hints)
    artifact_id, expires = record["id"], record["url_expires"]
    url, multipart, storage, ttl = None, None, s.storage, s.config.upload_ttl
    try:
        if not s.store.local and storage.offers("multipart") and storage.needs_multipart(body.size_bytes):
            plan = storage.start_multipart(upload_key(artifact_id), body.size_bytes, ttl)
            s.store.set_multipart(artifact_id, plan["upload_id"])
            multipart = {"part_size": plan["part_size"], "parts": plan["parts"]}
        elif not s.store.local:
            url = storage.presigned_url("PUT", upload_key(artifact_id), ttl, body.size_bytes)
    except BaseException:
        s.store.abandon(artifact_id, "the server could not prepare the upload")
        raise
    if url is None and multipart is None:
        url = s.signed_blob_url("put", artifact_id, body.size_bytes, expires)
    return {
        "artifact_id": artifact_id,
        "method": "PUT",
        "url": url,
        "headers": {"Content-Type": "application/octet-stream"},
        "expires_at": now_iso(expires),
        "multipart": multipart,
    }


@router.post(wire.CHUNKED_UPLOAD, response_model=ChunkedUploadGrant)
def chunked_upload(identity: Auth, body: ChunkedUploadRequest, s: Svc):
    """Start an upload by chunks: the objects missing for this tenant, each with a signed PUT URL
    (through this server, which checks each object's BLAKE3 digest as its bytes arrive)."""
    name = check_name(body.name)
    hints = body.manifest.model_dump(exclude_none=True) if body.manifest else {}
    for field, value in hints.items():
        check_hint(field, value)
    record = chunks.parse_record(body.record)
    row, objects, present = s.store.begin_chunked(identity.tenant, name, body.sha256, body.visibility, hints, record)
    expires = row["url_expires"]
    missing = [
        {"digest": d, "size_bytes": size, "url": s.signed_chunk_url("put", d, size, expires)}
        for d, size in sorted(objects.items())
        if d not in present
    ]
    return {
        "artifact_id": row["id"],
        "method": "PUT",
        "headers": {"Content-Type": "application/octet-stream"},
        "expires_at": now_iso(expires),
        "missing": missing,
        "objects": len(objects),
        "bytes_missing": sum(m["size_bytes"] for m in missing),
        "bytes_present": sum(size for d, size in objects.items() if d in present),
    }


@router.post(wire.ARTIFACT_CHUNKS, response_model=ChunksGrant)
def artifact_chunks(identity: MaybeAuth, artifact_id: str, s: Svc):
    """A ready chunked artifact's record and a signed GET URL per distinct object."""
    grant = chunks_grant(s, identity, artifact_id)
    if grant is None:
        raise not_found()
    return grant


def chunks_grant(
    s: Services, identity: Identity | None, artifact_id: str, whole_ok: bool = False, conn: sa.Connection | None = None
) -> dict | None:
    """What the chunks route answers for a ready artifact the caller may read (its own or a public
    one), also carried by a prefix lookup's answer (its row read on the lookup's ``conn``); None
    when it is not ready. An artifact stored whole is refused, or with ``whole_ok`` granted with no
    record and no objects."""
    row = s.store.readable(identity.tenant if identity else None, artifact_id, conn)
    if row.status != "ready":
        return None
    ttl = s.config.download_ttl
    expires = int(s.store.clock()) + ttl
    grant = {"artifact_id": artifact_id, "sha256": row.sha256, "size_bytes": row.size_bytes}
    if row.record is None:
        if not whole_ok:
            raise validation("this artifact is stored whole: download it with download-url")
        return {**grant, "record": None, "objects": [], "expires_at": now_iso(expires)}
    record = chunks.stored_record(row.record)
    objects = _signed_objects(s, record, ttl)
    return {**grant, "record": record.to_dict(), "objects": objects, "expires_at": now_iso(expires)}


def _signed_objects(s: Services, record, ttl: int) -> list[dict]:
    """``{digest, size_bytes, url}`` of each distinct object of ``record``: a GET URL signed for ``ttl`` s."""
    expires = int(s.store.clock()) + ttl
    objects = []
    for digest, size in sorted(chunks.objects_of(record).items()):
        url = None if s.store.local else s.storage.presigned_url("GET", chunks.object_key(digest), ttl)
        objects.append(
            {"digest": digest, "size_bytes": size, "url": url or s.signed_chunk_url("get", digest, size, expires)}
        )
    return objects


@router.post(wire.CONFIRM_UPLOAD, response_model=ArtifactRecord, response_model_exclude_unset=True)
def confirm_upload(identity: Auth, artifact_id: str, s: Svc, body: ConfirmRequest | None = None):
    check_id(artifact_id)
    parts = [p.model_dump() for p in body.parts] if body and body.parts else None
    return s.store.confirm(
        identity.tenant,
        artifact_id,
        parts,
        body.digest if body else None,
        body.size_bytes if body else None,
        replace=bool(body and body.replace),
    )


@router.get(wire.ARTIFACTS, response_model=ArtifactPage, response_model_exclude_unset=True)
def list_artifacts(identity: Auth, s: Svc, limit: int = 50, cursor: str | None = None, prefix: str = ""):
    if not 1 <= limit <= 500:
        raise validation("limit: must be between 1 and 500")
    if cursor is not None and not UUID.match(cursor):
        raise validation("cursor: not a cursor this server issued")
    prefix = check_prefix_filter(prefix)
    page, next_cursor = s.store.list_ready(identity.tenant, limit, cursor, prefix)
    return {"artifacts": page, "next_cursor": next_cursor}


@router.get(wire.ARTIFACT, response_model=ArtifactRecord, response_model_exclude_unset=True)
def get_artifact(identity: MaybeAuth, artifact_id: str, s: Svc):
    row = s.store.readable(identity.tenant if identity else None, artifact_id)
    return view(row, owner=identity is not None and row.tenant == identity.tenant)


@router.post(wire.DOWNLOAD_URL, response_model=DownloadGrant)
def download_url(identity: MaybeAuth, artifact_id: str, s: Svc):
    row = s.store.readable(identity.tenant if identity else None, artifact_id)
    if row.status != "ready":
        raise not_found()
    ttl = s.config.download_ttl
    expires = int(s.store.clock()) + ttl
    chunked = row.record is not None  # served rebuilt from its chunks by this server's blob route
    url = None if s.store.local or chunked else s.storage.presigned_url("GET", artifact_key(artifact_id), ttl)
    url = url or s.signed_blob_url("get", artifact_id, row.size_bytes, expires)
    return {
        "artifact_id": artifact_id,
        "download_url": url,
        "sha256": row.sha256,
        "size_bytes": row.size_bytes,
        "expires_at": now_iso(expires),
    }


@router.delete(wire.ARTIFACT, status_code=204)
def delete_artifact(identity: Auth, artifact_id: str, s: Svc):
    s.store.delete(identity.tenant, artifact_id)
    return Response(status_code=204)


def _infer(identity: Identity, artifact_id: str, body: InferRequest, request: Request, s: Services):
    # What needs no database first: a flood of requests over the limits, or finding no slot, is
    # refused at the least cost (inference.run checks both again, then takes the slot).
    s.inference.check_request(body.question, body.n)
    s.inference.slots.check(identity.tenant)
    ids = [artifact_id, *(body.compose or [])]
    rows = [_ready(s, identity, one) for one in ids]
    if s.remote is not None and body.compose is None and rows[0].record is not None:
        answer = _infer_remote(identity, artifact_id, rows[0], body, request, s)
        if answer is not None:
            return answer
    composing = None
    if body.compose is not None:
        # the sum of the headers' token counts (read at confirm), before any artifact or model loads
        s.inference.check_context(sum(_tokens(row) for row in rows), "the composed artifacts hold")
        composing = Composing(
            [
                ((row.tenant, one, row.sha256), _fetch(s, one), one)
                for one, row in zip(body.compose, rows[1:], strict=True)
            ],
            DEFAULT_RECOMPUTE if body.recompute is None else body.recompute,
            body.select or DEFAULT_COMPOSE_RULE,
        )
    result = s.inference.run(
        identity.tenant,
        (rows[0].tenant, artifact_id, rows[0].sha256),
        _fetch(s, artifact_id),
        body.question,
        body.n,
        disconnected=lambda: from_thread.run(request.is_disconnected),
        composing=composing,
    )
    answer = _answer(artifact_id, result)
    if result.composition is not None:
        c = result.composition
        answer["composition"] = {
            "artifact_ids": ids,
            **{k: c[k] for k in ("offsets", "recompute", "rule", "recomputed_tokens")},
        }
    return answer


def _infer_remote(identity: Identity, artifact_id: str, row, body: InferRequest, request: Request, s: Services):
    """One chunked artifact, answered by the vLLM server of ``--infer-engine``: the grant it gets
    is this artifact's record and a signed URL per object, valid for the request's timeout and a
    minute, so the engine reads this artifact and nothing else of the tenant's. None when the
    engine cannot load the artifact's representation: the in-process engine answers."""
    assert s.remote is not None
    ttl = int(s.config.infer_timeout) + 60
    record = chunks.stored_record(row.record)
    manifest = json.loads(row.manifest) if row.manifest else {}
    if not s.remote.loads(manifest, record.root):
        return None

    def grant() -> dict:
        return {"record": record.to_dict(), "urls": {o["digest"]: o["url"] for o in _signed_objects(s, record, ttl)}}

    result = s.remote.run(
        identity.tenant,
        artifact_id,
        manifest,
        _fetch(s, artifact_id),
        grant,
        body.question,
        body.n,
        disconnected=lambda: from_thread.run(request.is_disconnected),
    )
    return _answer(artifact_id, result)


def _answer(artifact_id: str, result) -> dict:
    """The infer answer's body, the same whichever engine computed it."""
    return {
        "artifact_id": artifact_id,
        "tokens": result.tokens,
        "token_count": len(result.tokens),
        "text": result.text,
        "model": result.model,
        "reused_tokens": result.reused_tokens,
        "question_tokens": result.question_tokens,
    }


def _ready(s: Services, identity: Identity, artifact_id: str):
    """The row of an artifact the caller may infer from: its own or a public one, ready; else 404."""
    row = s.store.readable(identity.tenant, artifact_id)
    if row.status != "ready":
        raise not_found()
    return row


def _tokens(row) -> int:
    return int((json.loads(row.manifest) if row.manifest else {}).get("tokens") or 0)


def _fetch(s: Services, artifact_id: str):
    """A local path of the artifact's `.kv` file when inference loads it (rebuilt if chunked)."""
    row = s.store.row(artifact_id)
    return lambda: s.store.artifact_copy(row)


@router.post(wire.INFER, response_model=InferAnswer, response_model_exclude_none=True)
def infer(identity: Auth, artifact_id: str, body: InferRequest, request: Request, s: Svc):
    return _infer(identity, artifact_id, body, request, s)


@router.post(wire.LEGACY_INFER, response_model=InferAnswer, response_model_exclude_none=True)
def infer_legacy(
    identity: Auth, org: str, project: str, artifact_id: str, body: InferRequest, request: Request, s: Svc
):
    return _infer(identity, artifact_id, body, request, s)
