"""What the routes work with, built once per app and reached through the ``services`` dependency."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from fastapi import Request

from kvcdn_core import StorageBackend
from kvcdn_server.apikeys import OrgRegistry
from kvcdn_server.artifacts import ArtifactStore
from kvcdn_server.config import ServerConfig
from kvcdn_server.inference import InferenceEngine
from kvcdn_server.oidc import JwtVerifier
from kvcdn_server.remote import RemoteEngine
from kvcdn_server.signing import UrlSigner
from kvcdn_server.telemetry import RateLimit, TelemetrySink


@dataclass
class Services:
    config: ServerConfig
    #: the SQLAlchemy engine of the database ("engine" alone is never the inference engine)
    db_engine: sa.Engine
    storage: StorageBackend
    store: ArtifactStore
    orgs: OrgRegistry
    verifier: JwtVerifier | None
    signer: UrlSigner
    inference: InferenceEngine
    limit: RateLimit
    telemetry: TelemetrySink
    public_base: str
    storage_kind: str
    #: the vLLM server ``infer`` is handed to (``--infer-engine``); None: the in-process engine
    remote: RemoteEngine | None = None

    def signed_blob_url(self, op: str, artifact_id: str, size: int, expires: int) -> str:
        """A server-signed blob URL on the configured public URL (never the request's Host header);
        its path holds nothing but the artifact's random id."""
        import kvcdn_wire as wire

        return (
            f"{self.public_base}{wire.path(wire.BLOB, artifact_id=artifact_id)}?"
            f"{self.signer.query(op, artifact_id, size, expires)}"
        )

    def signed_chunk_url(self, op: str, digest: str, size: int, expires: int) -> str:
        """A server-signed URL of one chunk object (its path holds nothing but the digest)."""
        import kvcdn_wire as wire

        obj = f"chunks/{digest}"
        return (
            f"{self.public_base}{wire.path(wire.BLOB_CHUNK, digest=digest)}?{self.signer.query(op, obj, size, expires)}"
        )


async def services(request: Request) -> Services:
    """The app's services (a dependency of every route). A coroutine: FastAPI runs a plain function
    dependency in its thread pool, a hand-off per request for one attribute read."""
    return request.app.state.services
