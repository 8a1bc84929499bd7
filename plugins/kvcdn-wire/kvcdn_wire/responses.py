"""The response bodies, as pydantic models: what the server answers and the client reads.

A field the server always sends is required; one it sends only sometimes has a default. Fields a
newer server adds are kept (``extra="allow"``), so an older client still reads the answer and
``model_dump(exclude_unset=True)`` gives back what the server sent. The client parses each body
once, with :func:`parse`; a body of another shape is one error, never a ``KeyError`` later.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class Answer(BaseModel):
    """A response body: known fields typed, unknown ones kept."""

    model_config = ConfigDict(extra="allow")


A = TypeVar("A", bound=Answer)


def parse(model: type[A], data: object) -> A:
    """``data`` (decoded JSON) as ``model``; raises :class:`pydantic.ValidationError` (a ValueError)."""
    return model.model_validate(data)


class ErrorBody(Answer):
    """Every refusal. ``error`` is an :class:`~kvcdn_wire.ErrorCode` value; a client keeps it a
    string, so that a code a newer server adds is still read."""

    error: str
    message: str


class Health(Answer):
    status: Literal["ok"]
    version: str
    #: the storage backend's kind: ``local``, or the first URI scheme of the backend (``s3``, ...)
    storage: str
    #: the database dialect: ``sqlite`` or ``postgresql``
    database: str


class Identity(Answer):
    """``GET /whoami``: who the credential is."""

    customer_id: str
    org: str | None
    project: str
    method: Literal["api_key", "oidc"]
    subject: str | None
    issuer: str | None
    email: str | None


class KeyVerification(Answer):
    """``POST /api-keys/verify``: the org a valid key belongs to."""

    customer_id: str
    org: str
    method: Literal["api_key"]


class Limits(Answer):
    artifacts: int
    storage_bytes: int
    max_artifact_bytes: int


class Usage(Answer):
    artifacts: int
    storage_bytes: int
    pending_artifacts: int
    pending_bytes: int


class SeedCounts(Answer):
    """The original client's quota table (one org, one project)."""

    organizations: int
    projects: int
    artifacts: int
    storage_bytes: int


class Quota(Answer):
    customer_id: str
    limits: Limits
    usage: Usage
    quota: SeedCounts
    used: SeedCounts


class OrgKey(Answer):
    """``POST /admin/api-keys`` and ``/admin/api-keys/rotate``: the org's current key."""

    api_key: str
    org_slug: str
    customer_id: str
    generation: int


class UploadPart(Answer):
    part_number: int = Field(ge=1)
    url: str
    #: bytes of this part; the part starts at ``(part_number - 1) * part_size``
    size: int = Field(ge=0)


class Multipart(Answer):
    part_size: int = Field(ge=1)
    parts: list[UploadPart]


class UploadGrant(Answer):
    """``POST /artifacts/upload-url``: PUT the bytes to ``url``, or each part to its own URL."""

    artifact_id: str
    method: Literal["PUT"]
    url: str | None
    headers: dict[str, str]
    expires_at: str
    multipart: Multipart | None


class ManifestSummary(Answer):
    """What listings show of an artifact's manifest (read from its header at confirm)."""

    model_id: str | None = None
    architecture: str | None = None
    tokens: int | None = None
    layers: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    format_version: int | None = None
    kvcdn_version: str | None = None


class ArtifactRecord(Answer):
    """An artifact as ``GET /artifacts/{id}``, lists and confirm show it.

    ``customer_id`` is the owner's, absent from someone else's public artifact. ``dtype`` ...
    ``quantized`` are the original client's list fields, read from the manifest.
    """

    artifact_id: str
    name: str
    visibility: Literal["private", "public"]
    #: pending (bytes awaited or uploaded), confirming (being checked) or ready
    status: str
    size_bytes: int
    sha256: str
    created_at: str
    confirmed_at: str | None
    #: the confirm's instant to the microsecond: orders artifacts of one name confirmed within a second
    confirmed_at_unix: float | None
    manifest: ManifestSummary | None
    customer_id: str | None = None
    dtype: str | None
    storage_dtype: str | None
    num_tokens: int | None
    num_layers: int | None
    quantized: bool
    #: stored as chunks (download it whole with download-url, or by its chunks)
    chunked: bool = False


class ArtifactPage(Answer):
    """``GET /artifacts``: one page of ready artifacts; pass ``next_cursor`` as ``cursor`` for the next."""

    artifacts: list[ArtifactRecord]
    next_cursor: str | None


class DownloadGrant(Answer):
    """``POST /artifacts/{id}/download-url``: GET ``download_url``; check the size and sha256."""

    artifact_id: str
    download_url: str
    sha256: str
    size_bytes: int
    expires_at: str


class InferComposition(Answer):
    """How the documents of a composed infer were put together (the local ``continue``'s fields)."""

    artifact_ids: list[str]
    offsets: list[int]
    recompute: float
    rule: str
    recomputed_tokens: int


class ObjectUrl(Answer):
    """One object of a chunked artifact (a chunk, a piece of one, or the tail) and its signed URL."""

    digest: str
    size_bytes: int
    url: str


class ChunkedUploadGrant(Answer):
    """``POST /artifacts/chunked-upload``: PUT each ``missing`` object to its URL, then confirm.

    ``missing`` lists what this tenant must upload; the other objects the record references are
    already held (by the tenant's own artifacts, or by public ones)."""

    artifact_id: str
    method: Literal["PUT"]
    headers: dict[str, str]
    expires_at: str
    missing: list[ObjectUrl]
    objects: int
    bytes_missing: int
    bytes_present: int


class ChunksGrant(Answer):
    """``POST /artifacts/{id}/chunks``: the record and a signed GET URL per distinct object; the
    client rebuilds the `.kv` file (checking each object's BLAKE3 digest) and its sha256."""

    artifact_id: str
    record: dict[str, Any]
    objects: list[ObjectUrl]
    sha256: str
    size_bytes: int
    expires_at: str


class InferAnswer(Answer):
    """``POST .../infer``: the greedy continuation; ``composition`` only when ``compose`` was asked."""

    artifact_id: str
    tokens: list[int]
    token_count: int
    text: str
    model: str
    reused_tokens: int
    question_tokens: int
    composition: InferComposition | None = None


class PrefixMatch(Answer):
    """One artifact of a lookup's answer. ``matched_tokens`` is exact when ``exact`` (the artifact
    ends there), else a whole number of chunks: the client refines it inside the next chunk from
    the artifact's token ids (``next_chunk``) or, for a whole-prefix artifact, its ``end_key``."""

    artifact_id: str
    name: str
    matched_tokens: int
    exact: bool
    token_count: int
    reuse: str
    compute_dtype: str | None
    quantization: str | None
    #: a whole-prefix candidate that ends inside a chunk: the key of all its tokens; it matches
    #: when the query's own tokens up to ``token_count`` have this key
    end_key: str | None = None
    #: an any-prefix match that goes on: the index in ``next_chunks`` of its token ids in the
    #: chunk after ``matched_tokens`` (the client's refinement: how many of them the query shares)
    next_chunk: int | None = None


class LookupGrant(Answer):
    """The best match's chunk grant in a lookup's answer (asked with ``grant``): as
    :class:`ChunksGrant`; ``record`` is None (and ``objects`` empty) for an artifact stored whole,
    or one the client said it holds (``held``)."""

    artifact_id: str
    record: dict[str, Any] | None
    objects: list[ObjectUrl]
    expires_at: str
    #: the client named it in ``held``: no record, no URLs, no expiry sent
    held: bool = False


class PrefixLookup(Answer):
    """``POST /prefix/lookup``: the longest matches among the caller's and published artifacts."""

    root: str
    #: how many of the query's full-chunk keys the index holds (a prefix: keys chain)
    matched_chunks: int
    chunk_tokens: int
    #: false when the matched node had more children in a scope than one answer refines among
    complete: bool
    #: the distinct next chunks of the matches, each its token ids as little-endian uint32, base64
    next_chunks: list[str]
    matches: list[PrefixMatch]
    #: asked with ``grant``: the chunk grant of the match the server ranks best (None: no match)
    grant: LookupGrant | None = None

    def next_tokens(self, match: PrefixMatch) -> list[int] | None:
        """A match's token ids in the chunk after its ``matched_tokens`` (None when it ends there)."""
        import base64
        import struct

        if match.next_chunk is None:
            return None
        data = base64.b64decode(self.next_chunks[match.next_chunk], validate=True)
        n = len(data) // 4
        return list(struct.unpack(f"<{n}I", data[: 4 * n]))


class PrefixRoot(Answer):
    """A root the caller can find artifacts under: the model fingerprint and representation."""

    root: str
    model: dict[str, object]
    compute_dtype: str | None
    quantization: str | None
    artifacts: int


class PrefixRoots(Answer):
    """``GET /prefix/roots``: the roots of the caller's own and of published artifacts."""

    roots: list[PrefixRoot]


__all__ = [
    "Answer",
    "ArtifactPage",
    "ArtifactRecord",
    "ChunkedUploadGrant",
    "ChunksGrant",
    "DownloadGrant",
    "ErrorBody",
    "Health",
    "Identity",
    "InferAnswer",
    "InferComposition",
    "LookupGrant",
    "KeyVerification",
    "Limits",
    "ManifestSummary",
    "Multipart",
    "ObjectUrl",
    "OrgKey",
    "PrefixLookup",
    "PrefixMatch",
    "PrefixRoot",
    "PrefixRoots",
    "Quota",
    "SeedCounts",
    "UploadGrant",
    "UploadPart",
    "Usage",
    "parse",
]
