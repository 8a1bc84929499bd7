"""The FastAPI app of ``kvcdn serve``: routes of docs/hosted-api.md over an :class:`ArtifactStore`.

Stateless processes: state lives in the database (``db.py``) and bytes in the storage backend, so
any number of replicas can serve one PostgreSQL database and one bucket. JSON routes are plain functions (FastAPI runs them in its thread pool, where the
blocking storage and model calls belong); the blob routes stream.
"""


import contextlib
import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvcdn_core
from kvcdn_core.errors import KvcdnError
from kvcdn_core.storage import LocalStorage, open_storage

from kvcdn_server.apikeys import OrgRegistry, check_slug
from kvcdn_server.artifacts import (UUID, ArtifactStore, artifact_key, check_id, check_name, now_iso, upload_key,
                                    view)
from kvcdn_server.config import ServerConfig
from kvcdn_server.db import open_database
from kvcdn_server.errors import ApiError, not_found, unauthorized, validation
from kvcdn_server.inference import InferenceEngine, ModelPolicy
from kvcdn_server.oidc import JwtVerifier
from kvcdn_server.signing import UrlSigner
from kvcdn_server.telemetry import MAX_BODY as TELEMETRY_MAX_BODY
from kvcdn_server.telemetry import RateLimit, TelemetryEvent, TelemetrySink

log = logging.getLogger("kvcdn.server")
API = "/api/v1"
MAX_JSON_BODY = 64 * 1024
#: where signed URLs point when no public URL is configured (``kvcdn serve`` sets the bound address)
DEFAULT_PUBLIC_URL = "http://127.0.0.1:8080"


# -- request bodies ------------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]


class ManifestHints(Strict):
    model_id: str | None = None
    architecture: str | None = None
    tokens: int | None = Field(None, ge=0, validation_alias=AliasChoices("tokens", "token_count"))
    layers: int | None = Field(None, ge=0)
    dtype: str | None = None
    quantization: str | None = None


class SeedMetadata(BaseModel):
    """``metadata`` as the original kvcdn client sends it (other keys are ignored)."""
    name: str | None = None
    sha256: Sha256 | None = None
    storage_dtype: str | None = None
    num_layers: int | None = Field(None, ge=0)
    quantized: bool | None = None


class UploadUrlRequest(Strict):
    """Native shape ``{name, size_bytes, sha256, visibility, manifest}``, or the original client's
    ``{model_name, dtype, num_tokens, visibility, size_bytes, checksum, metadata}``."""
    name: str | None = None
    model_name: str | None = None
    size_bytes: int = Field(ge=1)
    sha256: Sha256 | None = None
    checksum: Sha256 | None = None
    visibility: Literal["private", "public"] = "private"
    manifest: ManifestHints | None = None
    dtype: str | None = Field(None, max_length=64)
    num_tokens: int | None = Field(None, ge=0)
    metadata: SeedMetadata | None = None

    def resolved(self) -> tuple[str, str, dict[str, Any]]:
        """(name, sha256, declared manifest hints); several spellings of one fact must agree."""
        meta = self.metadata or SeedMetadata()
        name = next((n for n in (self.name, self.model_name, meta.name) if n is not None), None)
        if name is None:
            raise validation("name: a name (or model_name) is required")
        digests = {d.lower() for d in (self.sha256, self.checksum, meta.sha256) if d}
        if not digests:
            raise validation("sha256: a sha256 (or checksum) of the file is required")
        if len(digests) > 1:
            raise validation("sha256: sha256, checksum and metadata.sha256 disagree")
        hints = self.manifest.model_dump(exclude_unset=True) if self.manifest else {}
        # The original client sends 0 for what it does not know; a number it knows is checked.
        if self.num_tokens:
            hints.setdefault("tokens", self.num_tokens)
        if meta.num_layers:
            hints.setdefault("layers", meta.num_layers)
        return name, digests.pop(), hints


class Part(Strict):
    part_number: int = Field(ge=1, le=10000)
    etag: Annotated[str, StringConstraints(min_length=1, max_length=256)]


class ConfirmRequest(Strict):
    parts: list[Part] | None = Field(None, max_length=10000)
    #: the original client's confirm: the sha256 and size it uploaded (checked against the bytes)
    digest: Sha256 | None = None
    size_bytes: int | None = Field(None, ge=0)


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
        return self.customer_id

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

class RedactQueries(logging.Filter):
    """Access-log lines without query strings: a signed URL's signature must not end up in logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?…", *args[3:])
        return True


def redact_access_log() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQueries) for f in access.filters):
        access.addFilter(RedactQueries())


def create_app(config: ServerConfig, storage=None, engine=None) -> FastAPI:
    storage = storage or open_storage(config.storage_uri)
    engine = engine or open_database(config.database_url)
    store = ArtifactStore(engine, storage, config)
    orgs = OrgRegistry(config.api_key_seed, config.env_orgs, engine, config.orgs_refresh)
    verifier = (JwtVerifier(config.issuer_url, config.client_id, config.jwt_algorithms, config.jwt_leeway)
                if config.issuer_url else None)
    signer = UrlSigner(config.url_key)
    infer_engine = InferenceEngine(ModelPolicy(config.models), config.infer_concurrency, config.infer_timeout,
                                   config.infer_max_models, config.infer_cache_bytes, config.infer_device)
    limit = RateLimit(engine)
    telemetry = TelemetrySink(config.telemetry_url, config.telemetry_secret, limit)
    storage_kind = "local" if isinstance(storage, LocalStorage) else (type(storage).schemes or ("other",))[0]
    public_base = (config.public_url or DEFAULT_PUBLIC_URL).rstrip("/")
    stop = threading.Event()
    redact_access_log()

    def collector():
        while True:
            try:
                counts = store.collect()
                limit.forget_idle()
                if any(counts.values()):
                    log.info("garbage collection: %s", counts)
            except Exception:
                log.exception("garbage collection failed")
            if stop.wait(config.gc_interval):
                return

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        thread = threading.Thread(target=collector, name="kvcdn-collector", daemon=True)
        thread.start()
        yield
        stop.set()
        infer_engine.shutdown()

    app = FastAPI(title="kvcdn hosted API", version=kvcdn_core.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.store = store
    app.state.orgs = orgs
    app.state.engine = infer_engine
    app.state.db = engine
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

    @app.exception_handler(KvcdnError)
    async def storage_failed(_request, exc: KvcdnError):
        # Storage errors name internal object keys: log them, answer without them.
        log.error("storage error: %s", exc)
        return JSONResponse({"error": "storage_error", "message": "the object store failed; try again"},
                            status_code=502)

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

    def signed_blob_url(op: str, artifact_id: str, size: int, expires: int) -> str:
        # The configured public URL, never the request's Host header; the path holds only the
        # artifact's random id.
        return f"{public_base}{API}/blobs/{artifact_id}?{signer.query(op, artifact_id, size, expires)}"

    # -- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    def health():
        return {"status": "ok", "version": kvcdn_core.__version__, "storage": storage_kind,
                "database": engine.dialect.name}

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
        """The admin secret, as ``X-Kvcdn-Admin-Secret`` or (the original client) ``Authorization: Bearer``."""
        given = request.headers.get("x-kvcdn-admin-secret")
        if given is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else ""
        if not hmac.compare_digest(given.encode(), config.admin_secret.encode()):
            raise ApiError(403, "forbidden", "missing or wrong admin secret (X-Kvcdn-Admin-Secret or Bearer)")

    def slug_of(body: OrgRequest) -> str:
        try:
            return check_slug(body.org_slug.strip().lower())
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
        limits, used = store.limits(), store.usage(identity.tenant)
        return {"customer_id": identity.customer_id, "limits": limits, "usage": used,
                # the original client's table
                "quota": {"organizations": 1, "projects": 1, "artifacts": limits["artifacts"],
                          "storage_bytes": limits["storage_bytes"]},
                "used": {"organizations": 1, "projects": 1, "artifacts": used["artifacts"],
                         "storage_bytes": used["storage_bytes"]}}

    @app.post(f"{API}/artifacts/upload-url")
    def upload_url(identity: Auth, body: UploadUrlRequest):
        name, sha256, hints = body.resolved()
        name = check_name(name)
        record = store.begin_upload(identity.tenant, name, body.size_bytes, sha256, body.visibility, hints)
        artifact_id, expires = record["id"], record["url_expires"]
        url, multipart = None, None
        try:
            if not store.local and getattr(storage, "needs_multipart", None) and storage.needs_multipart(body.size_bytes):
                plan = storage.start_multipart(upload_key(artifact_id), body.size_bytes, config.upload_ttl)
                store.set_multipart(artifact_id, plan["upload_id"])
                multipart = {"part_size": plan["part_size"], "parts": plan["parts"]}
            elif not store.local:
                url = storage.presigned_url("PUT", upload_key(artifact_id), config.upload_ttl, body.size_bytes)
        except BaseException:
            store.abandon(artifact_id, "the server could not prepare the upload")
            raise
        if url is None and multipart is None:
            url = signed_blob_url("put", artifact_id, body.size_bytes, expires)
        return {"artifact_id": artifact_id, "method": "PUT", "url": url,
                "headers": {"Content-Type": "application/octet-stream"}, "expires_at": now_iso(expires),
                "multipart": multipart}

    @app.post(f"{API}/artifacts/{{artifact_id}}/confirm-upload")
    def confirm_upload(identity: Auth, artifact_id: str, body: ConfirmRequest | None = None):
        check_id(artifact_id)
        parts = [p.model_dump() for p in body.parts] if body and body.parts else None
        return store.confirm(identity.tenant, artifact_id, parts, body.digest if body else None,
                             body.size_bytes if body else None)

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
        row = store.readable(identity.tenant if identity else None, artifact_id)
        return view(row, owner=identity is not None and row.tenant == identity.tenant)

    @app.post(f"{API}/artifacts/{{artifact_id}}/download-url")
    def download_url(identity: MaybeAuth, artifact_id: str):
        row = store.readable(identity.tenant if identity else None, artifact_id)
        if row.status != "ready":
            raise not_found()
        expires = int(time.time()) + config.download_ttl
        url = None if store.local else storage.presigned_url("GET", artifact_key(artifact_id), config.download_ttl)
        url = url or signed_blob_url("get", artifact_id, row.size_bytes, expires)
        return {"artifact_id": artifact_id, "download_url": url, "sha256": row.sha256,
                "size_bytes": row.size_bytes, "expires_at": now_iso(expires)}

    @app.delete(f"{API}/artifacts/{{artifact_id}}", status_code=204)
    def delete_artifact(identity: Auth, artifact_id: str):
        store.delete(identity.tenant, artifact_id)
        return Response(status_code=204)

    def infer(identity: Identity, artifact_id: str, body: InferRequest):
        row = store.readable(identity.tenant, artifact_id)
        if row.status != "ready":
            raise not_found()
        key = (row.tenant, artifact_id, row.sha256)
        result = infer_engine.run(key, lambda: store.local_copy(artifact_key(artifact_id)), body.question, body.n)
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
    def telemetry_route(body: TelemetryEvent, request: Request):
        client = request.client.host if request.client else "unknown"
        if not telemetry.submit(body.model_dump(exclude_none=True), client):
            raise ApiError(429, "rate_limited", "too many telemetry events; slow down", {"Retry-After": "1"})
        return Response(status_code=204)

    # -- signed blob URLs (local storage) -------------------------------------------------------

    def checked_blob(op: str, artifact_id: str, request: Request) -> int:
        if not UUID.match(artifact_id):
            raise ApiError(403, "invalid_signature", "the URL is not a valid signed URL")
        return signer.check(op, artifact_id, request.query_params)

    @app.put(f"{API}/blobs/{{artifact_id}}")
    async def blob_put(artifact_id: str, request: Request):
        size = checked_blob("put", artifact_id, request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > size:
            raise ApiError(413, "payload_too_large", f"the body is larger than the signed {size} bytes")
        digest, written = hashlib.sha256(), 0
        receiving = store.receiving(artifact_id)
        target = await run_in_threadpool(receiving.__enter__)
        try:
            with open(target, "wb") as out:
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
        except BaseException as exc:
            await run_in_threadpool(receiving.__exit__, type(exc), exc, exc.__traceback__)
            raise
        await run_in_threadpool(receiving.__exit__, None, None, None)
        etag = f'"{digest.hexdigest()}"'
        return JSONResponse({"size_bytes": written, "sha256": digest.hexdigest()}, headers={"ETag": etag})

    @app.get(f"{API}/blobs/{{artifact_id}}")
    def blob_get(artifact_id: str, request: Request):
        checked_blob("get", artifact_id, request)
        row = store.ready_row(artifact_id)
        if row is None:
            raise not_found()
        headers = {"ETag": f'"{row.sha256}"', "Cache-Control": "private, no-store",
                   "Content-Length": str(row.size_bytes)}
        body = storage.open_read(artifact_key(artifact_id))

        def chunks():
            try:
                while block := body.read(1 << 20):
                    yield block
            finally:
                body.close()

        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    return app
