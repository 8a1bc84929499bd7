"""The FastAPI app of ``kvcdn serve``: routes of docs/hosted-api.md over an :class:`ArtifactStore`.

Stateless: everything durable lives in the storage backend, so any number of replicas can serve
the same bucket. JSON routes are plain functions (FastAPI runs them in its thread pool, where the
blocking storage and model calls belong); the blob routes stream.
"""


import contextlib
import hashlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvcdn_core
from kvcdn_core import LocalStorage, open_storage

from kvcdn_server.apikeys import OrgRegistry, check_slug
from kvcdn_server.artifacts import (TENANT, UUID, ArtifactStore, check_id, check_name, now_iso, public_view,
                                    tenant_of)
from kvcdn_server.config import ServerConfig
from kvcdn_server.errors import ApiError, not_found, unauthorized, validation
from kvcdn_server.inference import InferenceEngine, ModelPolicy
from kvcdn_server.oidc import JwtVerifier
from kvcdn_server.signing import UrlSigner
from kvcdn_server.telemetry import MAX_BODY as TELEMETRY_MAX_BODY
from kvcdn_server.telemetry import TelemetryEvent, TelemetrySink

log = logging.getLogger("kvcdn.server")
API = "/api/v1"
MAX_JSON_BODY = 64 * 1024
SWEEP_EVERY = 600.0


# -- request bodies ------------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ManifestHints(Strict):
    model_id: str | None = None
    architecture: str | None = None
    tokens: int | None = Field(None, ge=0, validation_alias=AliasChoices("tokens", "token_count"))
    layers: int | None = Field(None, ge=0)
    dtype: str | None = None
    quantization: str | None = None


class UploadUrlRequest(Strict):
    name: str
    size_bytes: int = Field(ge=1)
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]
    visibility: Literal["private", "public"] = "private"
    manifest: ManifestHints | None = None


class Part(Strict):
    part_number: int = Field(ge=1, le=10000)
    etag: Annotated[str, StringConstraints(min_length=1, max_length=256)]


class ConfirmRequest(Strict):
    parts: list[Part] | None = Field(None, max_length=10000)


class InferRequest(Strict):
    question: Annotated[str, StringConstraints(min_length=1, max_length=32768)]
    n: int = Field(ge=1, le=256)


class OrgRequest(Strict):
    org_slug: str


class VerifyRequest(Strict):
    api_key: str | None = None


# -- identity ---------------------------------------------------------------------------------------

@dataclass
class Identity:
    customer_id: str
    method: str  # api_key | oidc
    org: str | None = None
    subject: str | None = None
    issuer: str | None = None
    email: str | None = None

    @property
    def tenant(self) -> str:
        return tenant_of(self.customer_id)

    def as_dict(self) -> dict[str, Any]:
        return {"customer_id": self.customer_id, "org": self.org, "project": "default", "method": self.method,
                "subject": self.subject, "issuer": self.issuer, "email": self.email}


class BodyLimit:
    """Refuse JSON bodies over their limit (413) whether or not they declare a Content-Length."""

    class TooLarge(StarletteHTTPException):
        """Raised from ``receive``; an HTTP exception so that FastAPI's body reader passes it on."""

        def __init__(self, limit: int):
            super().__init__(413, f"request body is over {limit} bytes")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith(f"{API}/blobs/"):
            return await self.app(scope, receive, send)
        limit = TELEMETRY_MAX_BODY if scope["path"] == f"{API}/telemetry" else MAX_JSON_BODY
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_error(send, 413, "payload_too_large", f"request body is over {limit} bytes")
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyLimit.TooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyLimit.TooLarge:
            if not started:
                await _send_error(send, 413, "payload_too_large", f"request body is over {limit} bytes")


async def _send_error(send, status: int, code: str, message: str) -> None:
    response = JSONResponse({"error": code, "message": message}, status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": exc.code, "message": exc.message}, status_code=exc.status, headers=exc.headers)


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str]:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid" or (
                tuple(err.get("loc", ())) == ("body",) and err.get("type") in ("model_attributes_type", "dict_type")):
            return 400, "invalid_json", "the body must be a JSON object"
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return 422, "validation_error", f"{where}: {first.get('msg', 'invalid')}"


# -- the app ----------------------------------------------------------------------------------------

def create_app(config: ServerConfig, storage=None) -> FastAPI:
    storage = storage or open_storage(config.storage_uri)
    store = ArtifactStore(storage, config)
    orgs = OrgRegistry(config.api_key_seed, config.env_orgs, storage, config.orgs_refresh)
    verifier = (JwtVerifier(config.issuer_url, config.client_id, config.jwt_algorithms, config.jwt_leeway)
                if config.issuer_url else None)
    signer = UrlSigner(config.url_key)
    engine = InferenceEngine(ModelPolicy(config.models), config.infer_concurrency, config.infer_timeout,
                             config.infer_max_models, config.infer_cache_bytes, config.infer_device)
    telemetry = TelemetrySink(config.telemetry_url, config.telemetry_secret)
    storage_kind = "local" if isinstance(storage, LocalStorage) else (type(storage).schemes or ("other",))[0]
    stop = threading.Event()

    def sweeper():
        while not stop.wait(SWEEP_EVERY):
            try:
                removed = store.sweep_all()
                if removed:
                    log.info("removed %d expired pending upload(s)", removed)
            except Exception:
                log.exception("sweep of expired uploads failed")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        thread = threading.Thread(target=sweeper, name="kvcdn-sweeper", daemon=True)
        thread.start()
        yield
        stop.set()
        engine.shutdown()

    app = FastAPI(title="kvcdn hosted API", version=kvcdn_core.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.store = store
    app.state.orgs = orgs
    app.state.engine = engine
    app.add_middleware(BodyLimit)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        status, code, message = _validation_message(exc)
        return JSONResponse({"error": code, "message": message}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status_code,
                                                                                           "http_error")
        return JSONResponse({"error": code, "message": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def crashed(_request, exc: Exception):
        log.error("unhandled error", exc_info=exc)
        return JSONResponse({"error": "internal_error", "message": "internal server error"}, status_code=500)

    # -- identity ------------------------------------------------------------------------------

    def authenticate(request: Request, required: bool = True) -> Identity | None:
        header = request.headers.get("authorization")
        if not header:
            if required:
                raise unauthorized("this route needs Authorization: Bearer <token or kv_ API key>")
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("use Authorization: Bearer <token or kv_ API key>")
        if token.startswith("kv_"):
            org = orgs.verify(token)
            if org is None:
                raise unauthorized("invalid API key")
            identity = Identity(f"org:{org}", "api_key", org=org)
        else:
            if verifier is None:
                raise unauthorized("this server has no OIDC issuer configured; use an org API key")
            claims = verifier.verify(token)
            identity = Identity(claims.customer_id, "oidc", subject=claims.subject, issuer=claims.issuer,
                                email=claims.email)
        legacy_org = (request.path_params.get("org") or request.headers.get("x-kvcdn-org")
                      or request.query_params.get("org"))
        if legacy_org and identity.method == "api_key" and legacy_org != identity.org:
            raise ApiError(403, "forbidden", "the org given does not match the API key's org")
        return identity

    def identity_required(request: Request) -> Identity:
        return authenticate(request)

    def identity_optional(request: Request) -> Identity | None:
        return authenticate(request, required=False)

    Auth = Annotated[Identity, Depends(identity_required)]
    MaybeAuth = Annotated[Identity | None, Depends(identity_optional)]

    def base_url(request: Request) -> str:
        return (config.public_url or str(request.base_url)).rstrip("/")

    def signed_blob_url(request: Request, op: str, tenant: str, artifact_id: str, size: int, expires: int) -> str:
        obj = store.blob_object(tenant, artifact_id)
        return f"{base_url(request)}{API}/blobs/{obj}?{signer.query(op, obj, size, expires)}"

    # -- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    def health():
        return {"status": "ok", "version": kvcdn_core.__version__, "storage": storage_kind}

    @app.get(f"{API}/whoami")
    def whoami(identity: Auth):
        return identity.as_dict()

    @app.post(f"{API}/api-keys/verify")
    def verify_key(request: Request, body: VerifyRequest | None = None):
        key = (body.api_key if body else None)
        if key is None:
            header = request.headers.get("authorization", "")
            key = header.partition(" ")[2].strip() if header.lower().startswith("bearer ") else ""
        org = orgs.verify(key or "")
        if org is None:
            raise unauthorized("invalid API key")
        return {"customer_id": f"org:{org}", "org": org, "method": "api_key"}

    def require_admin(request: Request) -> None:
        import hmac

        given = request.headers.get("x-kvcdn-admin-secret", "").encode()
        if not hmac.compare_digest(given, config.admin_secret.encode()):
            raise ApiError(403, "forbidden", "missing or wrong X-Kvcdn-Admin-Secret")

    def slug_of(body: OrgRequest) -> str:
        try:
            return check_slug(body.org_slug)
        except ValueError as exc:
            raise validation(str(exc)) from None

    @app.post(f"{API}/admin/api-keys")
    def mint_key(body: OrgRequest, request: Request):
        require_admin(request)
        slug = slug_of(body)
        key, generation = orgs.register(slug)
        return {"api_key": key, "org_slug": slug, "customer_id": f"org:{slug}", "generation": generation}

    @app.post(f"{API}/admin/api-keys/rotate")
    def rotate_key(body: OrgRequest, request: Request):
        require_admin(request)
        slug = slug_of(body)
        rotated = orgs.rotate(slug)
        if rotated is None:
            raise not_found("org")
        key, generation = rotated
        return {"api_key": key, "org_slug": slug, "customer_id": f"org:{slug}", "generation": generation}

    @app.get(f"{API}/quota")
    def quota(identity: Auth):
        return {"customer_id": identity.customer_id, "limits": store.limits(),
                "usage": store.usage(identity.tenant)}

    @app.post(f"{API}/artifacts/upload-url")
    def upload_url(identity: Auth, body: UploadUrlRequest, request: Request):
        check_name(body.name)
        hints = body.manifest.model_dump(exclude_unset=True) if body.manifest else {}
        tenant = identity.tenant
        record = store.begin_upload(identity.customer_id, body.name, body.size_bytes, body.sha256,
                                    body.visibility, hints)
        artifact_id, expires = record["artifact_id"], record["url_expires"]
        upload_key = store.key(tenant, artifact_id, ".upload")
        url, multipart = None, None
        try:
            if not store.local and getattr(storage, "needs_multipart", None) and storage.needs_multipart(body.size_bytes):
                plan = storage.start_multipart(upload_key, body.size_bytes, config.upload_ttl)
                record["multipart"] = {"upload_id": plan["upload_id"]}
                multipart = {"part_size": plan["part_size"], "parts": plan["parts"]}
                store.save_pending(tenant, record)
            elif not store.local:
                url = storage.presigned_url("PUT", upload_key, config.upload_ttl, body.size_bytes)
        except BaseException:
            store._drop(tenant, artifact_id, record)  # give the reserved quota back
            raise
        if url is None and multipart is None:
            url = signed_blob_url(request, "put", tenant, artifact_id, body.size_bytes, expires)
        return {"artifact_id": artifact_id, "method": "PUT", "url": url,
                "headers": {"Content-Type": "application/octet-stream"}, "expires_at": now_iso(expires),
                "multipart": multipart}

    @app.post(f"{API}/artifacts/{{artifact_id}}/confirm-upload")
    def confirm_upload(identity: Auth, artifact_id: str, body: ConfirmRequest | None = None):
        check_id(artifact_id)
        parts = [p.model_dump() for p in body.parts] if body and body.parts else None
        return store.confirm(identity.tenant, artifact_id, parts)

    @app.get(f"{API}/artifacts")
    def list_artifacts(identity: Auth, limit: int = 50, cursor: str | None = None):
        if not 1 <= limit <= 500:
            raise validation("limit: must be between 1 and 500")
        if cursor is not None and not UUID.match(cursor):
            raise validation("cursor: not a cursor this server issued")
        page, next_cursor = store.list_ready(identity.tenant, limit, cursor)
        return {"artifacts": page, "next_cursor": next_cursor}

    @app.get(f"{API}/artifacts/{{artifact_id}}")
    def get_artifact(identity: MaybeAuth, artifact_id: str):
        owner, record = store.readable(identity.tenant if identity else None, artifact_id)
        return public_view(record, owner=identity is not None and owner == identity.tenant)

    @app.post(f"{API}/artifacts/{{artifact_id}}/download-url")
    def download_url(identity: MaybeAuth, artifact_id: str, request: Request):
        owner, record = store.readable(identity.tenant if identity else None, artifact_id)
        if record.get("status") != "ready":
            raise not_found()
        expires = int(time.time()) + config.download_ttl
        url = None if store.local else storage.presigned_url("GET", store.key(owner, artifact_id, ".kv"),
                                                             config.download_ttl)
        url = url or signed_blob_url(request, "get", owner, artifact_id, record["size_bytes"], expires)
        return {"artifact_id": artifact_id, "download_url": url, "sha256": record["sha256"],
                "size_bytes": record["size_bytes"], "expires_at": now_iso(expires)}

    @app.delete(f"{API}/artifacts/{{artifact_id}}", status_code=204)
    def delete_artifact(identity: Auth, artifact_id: str):
        store.delete(identity.tenant, artifact_id)
        return Response(status_code=204)

    def infer(identity: Identity, artifact_id: str, body: InferRequest):
        owner, record = store.readable(identity.tenant, artifact_id)
        if record.get("status") != "ready":
            raise not_found()
        key = (owner, artifact_id, record["sha256"])
        result = engine.run(key, lambda: store._local_copy(store.key(owner, artifact_id, ".kv")), body.question,
                            body.n)
        return {"artifact_id": artifact_id, "tokens": result.tokens, "token_count": len(result.tokens),
                "text": result.text, "model": result.model, "reused_tokens": result.reused_tokens,
                "question_tokens": result.question_tokens}

    @app.post(f"{API}/artifacts/{{artifact_id}}/infer")
    def infer_route(identity: Auth, artifact_id: str, body: InferRequest):
        return infer(identity, artifact_id, body)

    @app.post(f"{API}/orgs/{{org}}/projects/{{project}}/artifacts/{{artifact_id}}/infer")
    def infer_legacy(identity: Auth, org: str, project: str, artifact_id: str, body: InferRequest):
        return infer(identity, artifact_id, body)

    @app.post(f"{API}/telemetry", status_code=204)
    def telemetry_route(body: TelemetryEvent):
        if not telemetry.submit(body.model_dump(exclude_none=True)):
            raise ApiError(429, "rate_limited", "too many telemetry events; slow down", {"Retry-After": "1"})
        return Response(status_code=204)

    # -- signed blob URLs ---------------------------------------------------------------------

    def blob_names(tenant: str, artifact_id: str) -> str:
        if not TENANT.match(tenant) or not UUID.match(artifact_id):
            raise ApiError(403, "invalid_signature", "the URL is not a valid signed URL")
        return store.blob_object(tenant, artifact_id)

    @app.put(f"{API}/blobs/t/{{tenant}}/{{artifact_id}}")
    async def blob_put(tenant: str, artifact_id: str, request: Request):
        size = signer.check("put", blob_names(tenant, artifact_id), request.query_params)
        if await run_in_threadpool(store.pending, tenant, artifact_id) is None:
            if await run_in_threadpool(store.ready, tenant, artifact_id) is not None:
                raise ApiError(409, "already_confirmed", "this artifact is already confirmed")
            raise not_found()
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > size:
            raise ApiError(413, "payload_too_large", f"the body is larger than the signed {size} bytes")
        upload_key = store.key(tenant, artifact_id, ".upload")
        if store.local:
            target = storage.path_of(upload_key)
        else:
            store.tmp_dir.mkdir(parents=True, exist_ok=True)
            target = store.tmp_dir / f"{tenant}-{artifact_id}.upload"
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        digest, written = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in request.stream():
                    written += len(chunk)
                    if written > size:
                        raise ApiError(413, "payload_too_large", f"the body is larger than the signed {size} bytes")
                    digest.update(chunk)
                    await run_in_threadpool(out.write, chunk)
                if written != size:
                    raise ApiError(422, "size_mismatch", f"received {written} bytes, the URL is for {size}")
                out.flush()
                await run_in_threadpool(os.fsync, out.fileno())
            if store.local:
                os.replace(tmp, target)
            else:
                await run_in_threadpool(storage.put_file, upload_key, Path(tmp))
        finally:
            Path(tmp).unlink(missing_ok=True)
        etag = f'"{digest.hexdigest()}"'
        return JSONResponse({"size_bytes": written, "sha256": digest.hexdigest()}, headers={"ETag": etag})

    @app.get(f"{API}/blobs/t/{{tenant}}/{{artifact_id}}")
    def blob_get(tenant: str, artifact_id: str, request: Request):
        signer.check("get", blob_names(tenant, artifact_id), request.query_params)
        record = store.ready(tenant, artifact_id)
        if record is None:
            raise not_found()
        kv_key = store.key(tenant, artifact_id, ".kv")
        headers = {"ETag": f'"{record["sha256"]}"', "Cache-Control": "private, no-store"}
        if store.local:
            return FileResponse(storage.path_of(kv_key), media_type="application/octet-stream", headers=headers)
        body = storage.open_read(kv_key)

        def chunks():
            try:
                while block := body.read(1 << 20):
                    yield block
            finally:
                body.close()

        headers["Content-Length"] = str(record["size_bytes"])
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    return app
