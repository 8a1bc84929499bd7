"""kvcdn-wire: the hosted API's contract, shared by the server (``kvcdn serve``) and its client.

- :mod:`kvcdn_wire.routes`: route paths and body limits (standard library only);
- :mod:`kvcdn_wire.codes`: :class:`ErrorCode`, every ``error`` the server answers (standard library only);
- :mod:`kvcdn_wire.requests`, :mod:`kvcdn_wire.responses`: the bodies, as pydantic models;
- :mod:`kvcdn_wire.telemetry`: the telemetry event.

Importing the package itself loads only the first two, so that a client command's start-up pays
nothing for pydantic; the models load when a module imports them. docs/hosted-api.md describes it all.
"""

from kvcdn_wire.codes import CONFIRM_MAYBE_DONE, NOT_DONE_UNAVAILABLE, ErrorCode
from kvcdn_wire.routes import (
    ADMIN_API_KEYS,
    ADMIN_ROTATE,
    API,
    ARTIFACT,
    ARTIFACT_CHUNKS,
    ARTIFACTS,
    BLOB,
    BLOB_CHUNK,
    BLOBS_PREFIX,
    CHUNKED_UPLOAD,
    CONFIRM_UPLOAD,
    DOWNLOAD_URL,
    HEALTH,
    INFER,
    LEGACY_INFER,
    MAX_CHUNKED_BODY,
    MAX_INFER_TOKENS,
    MAX_JSON_BODY,
    MAX_LOOKUP_BODY,
    MAX_LOOKUP_KEYS,
    MAX_LOOKUP_LIMIT,
    MAX_QUESTION_CHARS,
    MAX_TELEMETRY_BODY,
    PREFIX_LOOKUP,
    PREFIX_ROOTS,
    QUOTA,
    TELEMETRY,
    UPLOAD_URL,
    VERIFY_API_KEY,
    WHOAMI,
    path,
)

__version__ = "0.1.0"

__all__ = [
    "ADMIN_API_KEYS",
    "ADMIN_ROTATE",
    "API",
    "ARTIFACT",
    "ARTIFACT_CHUNKS",
    "ARTIFACTS",
    "BLOB",
    "BLOB_CHUNK",
    "BLOBS_PREFIX",
    "CHUNKED_UPLOAD",
    "CONFIRM_MAYBE_DONE",
    "CONFIRM_UPLOAD",
    "DOWNLOAD_URL",
    "HEALTH",
    "INFER",
    "LEGACY_INFER",
    "MAX_CHUNKED_BODY",
    "MAX_INFER_TOKENS",
    "MAX_JSON_BODY",
    "MAX_LOOKUP_BODY",
    "MAX_LOOKUP_KEYS",
    "MAX_LOOKUP_LIMIT",
    "MAX_QUESTION_CHARS",
    "MAX_TELEMETRY_BODY",
    "NOT_DONE_UNAVAILABLE",
    "PREFIX_LOOKUP",
    "PREFIX_ROOTS",
    "QUOTA",
    "TELEMETRY",
    "UPLOAD_URL",
    "VERIFY_API_KEY",
    "WHOAMI",
    "ErrorCode",
    "path",
]
