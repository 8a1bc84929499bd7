"""Route paths (templates name their parameters as FastAPI does) and body limits."""

from __future__ import annotations

from urllib.parse import quote

API = "/api/v1"

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
#: start a chunked upload (the record; the server answers which objects are missing)
CHUNKED_UPLOAD = f"{API}/artifacts/chunked-upload"
#: a chunked artifact's record and a signed GET URL per object
ARTIFACT_CHUNKS = f"{API}/artifacts/{{artifact_id}}/chunks"
INFER = f"{API}/artifacts/{{artifact_id}}/infer"
#: the original client's infer route (org and project are ignored: the credential names the tenant)
LEGACY_INFER = f"{API}/orgs/{{org}}/projects/{{project}}/artifacts/{{artifact_id}}/infer"
TELEMETRY = f"{API}/telemetry"
#: the prefix index: the longest match for a query's chain keys, and the roots a caller can search
PREFIX_LOOKUP = f"{API}/prefix/lookup"
PREFIX_ROOTS = f"{API}/prefix/roots"
BLOB = f"{API}/blobs/{{artifact_id}}"
BLOBS_PREFIX = f"{API}/blobs/"
#: one chunk object, named by its BLAKE3 digest (signed PUT and GET)
BLOB_CHUNK = f"{API}/blobs/chunks/{{digest}}"


def path(template: str, **params: str) -> str:
    """A route with its parameters filled in, each quoted as one path segment."""
    return template.format(**{name: quote(str(value), safe="") for name, value in params.items()})


#: bytes of a JSON request body (``413 payload_too_large`` above)
MAX_JSON_BODY = 64 * 1024
#: bytes of a chunked upload's body: a record holds the `.kv` header (up to 16 MiB) and its chunk list
MAX_CHUNKED_BODY = 32 * 1024 * 1024
#: bytes of a telemetry event
MAX_TELEMETRY_BODY = 8 * 1024
#: characters of an infer question, and tokens an infer may ask for (the request model's bounds)
MAX_QUESTION_CHARS = 32768
MAX_INFER_TOKENS = 256
#: artifacts an infer may compose after the route's own (``compose``)
MAX_COMPOSE_ARTIFACTS = 15
#: full-chunk keys of one lookup (512 chunks of 256 tokens: a 131,072-token query), and bytes of
#: its body: 512 keys and 513 block keys as JSON are about 70 kB, over MAX_JSON_BODY
MAX_LOOKUP_KEYS = 512
MAX_LOOKUP_BODY = 128 * 1024
#: matches one lookup may ask for
MAX_LOOKUP_LIMIT = 50
