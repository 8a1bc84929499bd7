"""The hosted API's wire contract, shared by the server (``kvcdn serve``) and this client: route
paths, error codes and body limits (docs/hosted-api.md describes them).

Standard library only, so that the client imports it at no start-up cost; the pydantic request
models and the telemetry schema are in :mod:`kvcdn_hosted.wire_schema`.
"""

from __future__ import annotations

from urllib.parse import quote

API = "/api/v1"

# -- routes (templates name their path parameters as FastAPI does) -------------------------------
HEALTH = "/health"
WHOAMI = f"{API}/whoami"
QUOTA = f"{API}/quota"
VERIFY_API_KEY = f"{API}/api-keys/verify"
ADMIN_API_KEYS = f"{API}/admin/api-keys"
ADMIN_ROTATE = f"{API}/admin/api-keys/rotate"
UPLOAD_URL = f"{API}/artifacts/upload-url"
ARTIFACTS = f"{API}/artifacts"
ARTIFACT = f"{API}/artifacts/{{artifact_id}}"
CONFIRM_UPLOAD = f"{API}/artifacts/{{artifact_id}}/confirm-upload"
DOWNLOAD_URL = f"{API}/artifacts/{{artifact_id}}/download-url"
INFER = f"{API}/artifacts/{{artifact_id}}/infer"
LEGACY_INFER = f"{API}/orgs/{{org}}/projects/{{project}}/artifacts/{{artifact_id}}/infer"
TELEMETRY = f"{API}/telemetry"
BLOB = f"{API}/blobs/{{artifact_id}}"
BLOBS_PREFIX = f"{API}/blobs/"


def path(template: str, **params: str) -> str:
    """A route with its parameters filled in, each quoted as one path segment."""
    return template.format(**{name: quote(str(value), safe="") for name, value in params.items()})


# -- limits ---------------------------------------------------------------------------------------
MAX_JSON_BODY = 64 * 1024
MAX_TELEMETRY_BODY = 8 * 1024
MAX_QUESTION_CHARS = 32768
MAX_INFER_TOKENS = 256

# -- error codes: every refusal is {"error": <code>, "message": <one line>} -----------------------
INVALID_JSON = "invalid_json"
UNAUTHORIZED = "unauthorized"
FORBIDDEN = "forbidden"
INVALID_SIGNATURE = "invalid_signature"
URL_EXPIRED = "url_expired"
QUOTA_EXCEEDED = "quota_exceeded"
NOT_FOUND = "not_found"
UPLOAD_INCOMPLETE = "upload_incomplete"
ALREADY_CONFIRMED = "already_confirmed"
CONFIRM_IN_PROGRESS = "confirm_in_progress"
UPLOAD_IN_PROGRESS = "upload_in_progress"
UPLOAD_FAILED = "upload_failed"
UPLOAD_EXPIRED = "upload_expired"
PAYLOAD_TOO_LARGE = "payload_too_large"
VALIDATION_ERROR = "validation_error"
INVALID_NAME = "invalid_name"
SIZE_MISMATCH = "size_mismatch"
SHA256_MISMATCH = "sha256_mismatch"
NOT_A_KV_ARTIFACT = "not_a_kv_artifact"
MANIFEST_MISMATCH = "manifest_mismatch"
RATE_LIMITED = "rate_limited"
STORAGE_ERROR = "storage_error"
DATABASE_UNAVAILABLE = "database_unavailable"
INTERNAL_ERROR = "internal_error"

#: a confirm answered with one of these may have been (or is being) done by an earlier attempt:
#: the client waits for the artifact to show up as ready
CONFIRM_MAYBE_DONE = frozenset({ALREADY_CONFIRMED, CONFIRM_IN_PROGRESS})
#: a 503 with this code changed nothing the request asked for (the database could not be reached,
#: or a confirm was handed back): any request, a POST too, may be sent again after ``Retry-After``
NOT_DONE_UNAVAILABLE = frozenset({DATABASE_UNAVAILABLE})
