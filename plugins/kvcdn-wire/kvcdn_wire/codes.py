"""Every ``error`` code the server answers: a refusal is ``{"error": <code>, "message": <one line>}``.

Clients branch on the code (stable) and show the message (may change). docs/hosted-api.md lists
each code with its status; a test keeps that table and this enum the same.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """A code is its value wherever a string is expected (``ErrorCode.NOT_FOUND == "not_found"``)."""

    # the request itself
    INVALID_JSON = "invalid_json"
    VALIDATION_ERROR = "validation_error"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    # who is asking
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    ISSUER_UNAVAILABLE = "issuer_unavailable"
    INVALID_SIGNATURE = "invalid_signature"
    URL_EXPIRED = "url_expired"
    RATE_LIMITED = "rate_limited"
    # artifacts and the upload state machine
    NOT_FOUND = "not_found"
    INVALID_NAME = "invalid_name"
    QUOTA_EXCEEDED = "quota_exceeded"
    UPLOAD_INCOMPLETE = "upload_incomplete"
    ALREADY_CONFIRMED = "already_confirmed"
    CONFIRM_IN_PROGRESS = "confirm_in_progress"
    UPLOAD_IN_PROGRESS = "upload_in_progress"
    UPLOAD_FAILED = "upload_failed"
    UPLOAD_EXPIRED = "upload_expired"
    CONFLICT = "conflict"
    SIZE_MISMATCH = "size_mismatch"
    SHA256_MISMATCH = "sha256_mismatch"
    NOT_A_KV_ARTIFACT = "not_a_kv_artifact"
    MANIFEST_MISMATCH = "manifest_mismatch"
    INVALID_RECORD = "invalid_record"
    DIGEST_MISMATCH = "digest_mismatch"
    # inference
    MODEL_NOT_AVAILABLE = "model_not_available"
    ARTIFACT_INCOMPATIBLE = "artifact_incompatible"
    ARTIFACT_TOO_LARGE = "artifact_too_large"
    QUESTION_TOO_LONG = "question_too_long"
    TOO_MANY_TOKENS = "too_many_tokens"
    CONTEXT_TOO_LONG = "context_too_long"
    DTYPE_MISMATCH = "dtype_mismatch"
    MODELS_DIFFER = "models_differ"
    BUSY = "busy"
    TIMEOUT = "timeout"
    CLIENT_CLOSED_REQUEST = "client_closed_request"
    # the server's own dependencies
    DATABASE_UNAVAILABLE = "database_unavailable"
    STORAGE_ERROR = "storage_error"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    INTERNAL_ERROR = "internal_error"

    def __str__(self) -> str:
        return self.value


#: a confirm answered with one of these may have been (or is being) done by an earlier attempt:
#: the client waits for the artifact to show up as ready
CONFIRM_MAYBE_DONE = frozenset({ErrorCode.ALREADY_CONFIRMED, ErrorCode.CONFIRM_IN_PROGRESS})
#: a 503 with this code changed nothing the request asked for (the database could not be reached,
#: or a confirm was handed back): any request, a POST too, may be sent again after ``Retry-After``
NOT_DONE_UNAVAILABLE = frozenset({ErrorCode.DATABASE_UNAVAILABLE})
