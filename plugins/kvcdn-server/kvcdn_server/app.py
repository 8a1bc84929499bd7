"""The FastAPI app of ``kvcdn serve``: the routers of ``routes/`` (docs/hosted-api.md) over shared services.

Stateless processes: state lives in the database (``db.py``) and bytes in the storage backend, so
any number of replicas can serve one PostgreSQL database and one bucket. JSON routes are plain
functions (FastAPI runs them in its thread pool, where the blocking storage and model calls
belong); the blob routes stream. Route paths, request models and error codes come from the wire
contract shared with the client (the ``kvcdn-wire`` package).
"""

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvcdn_core
import kvcdn_wire as wire
from kvcdn_core import KvcdnError, open_storage
from kvcdn_server.apikeys import OrgRegistry
from kvcdn_server.artifacts import ArtifactStore
from kvcdn_server.config import ServerConfig
from kvcdn_server.db import open_database
from kvcdn_server.errors import ApiError, database_unavailable, is_database_outage, outage_summary
from kvcdn_server.inference import InferenceEngine
from kvcdn_server.oidc import JwtVerifier
from kvcdn_server.remote import RemoteEngine
from kvcdn_server.routes import account, admin, artifacts, blobs, prefix, telemetry
from kvcdn_server.services import Services
from kvcdn_server.signing import UrlSigner
from kvcdn_server.telemetry import RateLimit, TelemetrySink
from kvcdn_wire import ErrorCode

log = logging.getLogger("kvcdn.server")
#: where signed URLs point when no public URL is configured (``kvcdn serve`` sets the bound address)
DEFAULT_PUBLIC_URL = "http://127.0.0.1:8080"
#: the codes of the errors Starlette itself raises (an unknown route, a wrong method)
HTTP_ERROR_CODES = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
}


class BodyLimit:
    """Refuse JSON bodies over their limit (413) whether or not they declare a Content-Length."""

    class TooLarge(StarletteHTTPException):
        """Raised from ``receive``; an HTTP exception so that FastAPI's body reader passes it on."""

        def __init__(self, limit: int):
            super().__init__(413, f"request body is over {limit} bytes")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith(wire.BLOBS_PREFIX):
            return await self.app(scope, receive, send)
        limits = {
            wire.TELEMETRY: wire.MAX_TELEMETRY_BODY,
            wire.CHUNKED_UPLOAD: wire.MAX_CHUNKED_BODY,
            wire.PREFIX_LOOKUP: wire.MAX_LOOKUP_BODY,
        }
        limit = limits.get(scope["path"], wire.MAX_JSON_BODY)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_error(send, 413, ErrorCode.PAYLOAD_TOO_LARGE, f"request body is over {limit} bytes")
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
                await _send_error(send, 413, ErrorCode.PAYLOAD_TOO_LARGE, f"request body is over {limit} bytes")


async def _send_error(send, status: int, code: ErrorCode, message: str) -> None:
    response = JSONResponse({"error": code.value, "message": message}, status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": exc.code.value, "message": exc.message}, status_code=exc.status, headers=exc.headers)


def _validation_message(exc: RequestValidationError) -> tuple[int, ErrorCode, str]:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid" or (
            tuple(err.get("loc", ())) == ("body",) and err.get("type") in ("model_attributes_type", "dict_type")
        ):
            return 400, ErrorCode.INVALID_JSON, "the body must be a JSON object"
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return 422, ErrorCode.VALIDATION_ERROR, f"{where}: {first.get('msg', 'invalid')}"


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


def build_services(
    config: ServerConfig, storage=None, db_engine=None, clock: Callable[[], float] = time.time
) -> Services:
    """``clock`` (seconds since the epoch) times every expiry, lease and signed URL; only a test
    running the app in-process passes another, to move time on without sleeping."""
    storage = storage or open_storage(config.storage_uri)
    if type(storage).stores != "bytes" or "rename" in type(storage).unsupported:
        # uploads are kept as they arrive, checked, then renamed out of the upload URL's reach
        raise KvcdnError(
            f"storage '{config.storage_uri}' cannot hold a server's objects: it must store any bytes and rename"
        )
    db_engine = db_engine or open_database(config.database_url)
    limit = RateLimit(db_engine)
    inference = InferenceEngine.from_config(config)
    return Services(
        config=config,
        db_engine=db_engine,
        storage=storage,
        store=ArtifactStore(db_engine, storage, config, clock),
        orgs=OrgRegistry(config.api_key_seed, config.env_orgs, db_engine, config.orgs_refresh),
        verifier=(
            JwtVerifier(config.issuer_url, config.client_id, config.jwt_algorithms, config.jwt_leeway)
            if config.issuer_url
            else None
        ),
        signer=UrlSigner(config.url_key, clock),
        inference=inference,
        limit=limit,
        telemetry=TelemetrySink(config.telemetry_url, config.telemetry_secret, limit),
        public_base=(config.public_url or DEFAULT_PUBLIC_URL).rstrip("/"),
        # what /health shows: "local" for objects on this machine's disk, else the backend's scheme
        storage_kind="local" if type(storage).offers("local_path") else (type(storage).schemes or ("other",))[0],
        remote=RemoteEngine(config.infer_engine, inference) if config.infer_engine else None,
    )


def create_app(config: ServerConfig, storage=None, db_engine=None, clock: Callable[[], float] = time.time) -> FastAPI:
    s = build_services(config, storage, db_engine, clock)
    stop = threading.Event()
    redact_access_log()

    def collector():
        unindexed = True  # the first pass also indexes artifacts confirmed before the prefix index
        while True:
            try:
                if unindexed:
                    indexed = s.store.index_unindexed()
                    unindexed = False
                    if indexed:
                        log.info("prefix index: indexed %d artifacts confirmed before it existed", indexed)
                counts = s.store.collect()
                s.limit.forget_idle()
                if any(counts.values()):
                    log.info("garbage collection: %s", counts)
            except Exception as exc:
                if not is_database_outage(exc):
                    log.exception("garbage collection failed")
                else:  # one line per pass while the database is away, and leases are judged later
                    s.store.note_outage()
                    log.warning("garbage collection skipped: database unavailable (%s)", outage_summary(exc))
            if stop.wait(config.gc_interval):
                return

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        thread = threading.Thread(target=collector, name="kvcdn-collector", daemon=True)
        thread.start()
        yield
        stop.set()
        s.inference.shutdown()
        if s.remote is not None:
            s.remote.close()

    # No trailing-slash redirects: their Location would be built from the request's Host header.
    app = FastAPI(
        title="kvcdn hosted API",
        version=kvcdn_core.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
    )
    app.state.services = s  # the one way in: routes (``services.services``) and tests alike
    app.add_middleware(BodyLimit)
    for router in (account.router, admin.router, artifacts.router, blobs.router, prefix.router, telemetry.router):
        app.include_router(router)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        status, code, message = _validation_message(exc)
        return JSONResponse({"error": code.value, "message": message}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        code = HTTP_ERROR_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
        return JSONResponse({"error": code.value, "message": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(KvcdnError)
    async def storage_failed(_request, exc: KvcdnError):
        # Storage errors name internal object keys: log them, answer without them.
        log.error("storage error: %s", exc)
        return JSONResponse(
            {"error": ErrorCode.STORAGE_ERROR.value, "message": "the object store failed; try again"}, status_code=502
        )

    @app.exception_handler(sa.exc.SQLAlchemyError)
    async def database_failed(request, exc: sa.exc.SQLAlchemyError):
        # Handled here, not by the catch-all below, whose middleware logs and re-raises (a traceback).
        if not is_database_outage(exc):
            return await crashed(request, exc)
        s.store.note_outage()
        log.warning(
            "database unavailable: %s %s answered 503 (%s)", request.method, request.url.path, outage_summary(exc)
        )
        return _error_response(database_unavailable())

    @app.exception_handler(Exception)
    async def crashed(_request, exc: Exception):
        log.error("unhandled error", exc_info=exc)
        return JSONResponse(
            {"error": ErrorCode.INTERNAL_ERROR.value, "message": "internal server error"}, status_code=500
        )

    return app
