"""The request bodies, as pydantic models: the server validates with them, the client builds its
bodies with them. Unknown fields are refused; the original kvcdn client's spellings are accepted."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from kvcdn_wire.routes import (
    MAX_COMPOSE_ARTIFACTS,
    MAX_INFER_TOKENS,
    MAX_LOOKUP_KEYS,
    MAX_LOOKUP_LIMIT,
    MAX_QUESTION_CHARS,
)

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]
#: a chain key (kvcdn_core.store.keys): 64 lowercase hex digits, as the keys are computed
ChainKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class Strict(BaseModel):
    """Unknown fields are refused (``422 validation_error``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ManifestHints(Strict):
    model_id: str | None = None
    architecture: str | None = None
    tokens: int | None = Field(default=None, ge=0, validation_alias=AliasChoices("tokens", "token_count"))
    layers: int | None = Field(default=None, ge=0)
    dtype: str | None = None
    quantization: str | None = None


class SeedMetadata(BaseModel):
    """``metadata`` as the original kvcdn client sends it (other keys are ignored)."""

    name: str | None = None
    sha256: Sha256 | None = None
    storage_dtype: str | None = None
    num_layers: int | None = Field(default=None, ge=0)
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
    dtype: str | None = Field(default=None, max_length=64)
    num_tokens: int | None = Field(default=None, ge=0)
    metadata: SeedMetadata | None = None

    def resolved(self) -> tuple[str, str, dict[str, Any]]:
        """(name, sha256, declared manifest hints); several spellings of one fact must agree.

        Raises ValueError (a ``422 validation_error``) when a fact is missing or spelled twice differently.
        """
        meta = self.metadata or SeedMetadata()
        name = next((n for n in (self.name, self.model_name, meta.name) if n is not None), None)
        if name is None:
            raise ValueError("name: a name (or model_name) is required")
        digests = {d.lower() for d in (self.sha256, self.checksum, meta.sha256) if d}
        if not digests:
            raise ValueError("sha256: a sha256 (or checksum) of the file is required")
        if len(digests) > 1:
            raise ValueError("sha256: sha256, checksum and metadata.sha256 disagree")
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


class ChunkedUploadRequest(Strict):
    """``POST /artifacts/chunked-upload``: the artifact as a record (header and chunk plan, as
    ``kvcdn_core.store.record`` writes it) and the sha256 of the whole `.kv` file it rebuilds."""

    name: str
    sha256: Sha256
    visibility: Literal["private", "public"] = "private"
    record: dict[str, Any]
    manifest: ManifestHints | None = None


class ConfirmRequest(Strict):
    parts: list[Part] | None = Field(default=None, max_length=10000)
    #: the original client's confirm: the sha256 and size it uploaded (checked against the bytes)
    digest: Sha256 | None = None
    size_bytes: int | None = Field(default=None, ge=0)
    #: delete the caller's other ready artifacts of this name in the same step (the storage backend's overwrite)
    replace: bool = False


class InferRequest(Strict):
    """``{question, n}`` continues one artifact. ``compose`` (artifact ids) adds more documents after
    the route's artifact, in that order, as local ``kvcdn continue --kv-path A --kv-path B`` does;
    ``recompute`` and ``select`` tune that composition and are refused without it; left out, the
    server takes the local defaults (the wire names the rules and a test keeps them the core's)."""

    question: Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUESTION_CHARS)]
    n: int = Field(ge=1, le=MAX_INFER_TOKENS)
    compose: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] | None = Field(
        default=None, min_length=1, max_length=MAX_COMPOSE_ARTIFACTS
    )
    recompute: float | None = Field(default=None, ge=0.0, le=1.0)
    select: Literal["deviation", "doc-start"] | None = None

    @model_validator(mode="after")
    def _knobs_need_a_composition(self) -> InferRequest:
        if self.compose is None and (self.recompute is not None or self.select is not None):
            raise ValueError("recompute and select compose several artifacts: name the others in compose")
        return self


#: base64 of up to 16 four-byte key prefixes (:func:`kvcdn_core.store.keys.steps`)
LookupSteps = Annotated[
    str, StringConstraints(pattern=r"^(?:[A-Za-z0-9+/]{4}){0,21}(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")
]


class LookupRequest(Strict):
    """``POST /prefix/lookup``: a query as chain keys under one root, never its token ids.

    ``keys``: the keys of the query's full chunks, in order (a query shorter than a chunk sends
    none: its match is refined among the root's children); ``blocks``: the key of the first 16
    tokens of each of its chunks, full or not, in order, while it has 16 (they narrow the children
    refined among to those sharing them).
    """

    root: ChainKey
    keys: list[ChainKey] = Field(default_factory=list, max_length=MAX_LOOKUP_KEYS)
    blocks: list[ChainKey] = Field(default_factory=list, max_length=MAX_LOOKUP_KEYS + 1)
    limit: int = Field(default=10, ge=1, le=MAX_LOOKUP_LIMIT)
    #: ask for the best match's chunk grant (record and signed GET URLs) in the answer
    grant: bool = False
    #: per chunk, as ``blocks``: base64 of the first 4 bytes of the key of its first 16, 32, ...
    #: tokens (at most 16 such keys): they let the server rank the candidates to 16 tokens, so the
    #: grant is the match the client's refinement picks
    steps: list[LookupSteps] = Field(default_factory=list, max_length=MAX_LOOKUP_KEYS + 1)
    #: artifact ids whose grants the client holds: when the best match is one, the answer names it
    #: (``held``) without its record and URLs
    held: list[Annotated[str, StringConstraints(max_length=36)]] = Field(default_factory=list, max_length=16)
    #: after an answer with ``complete: false``: the keys of the query's first 1 to 15 tokens after
    #: its first ``heads_at`` chunks (``matched_chunks``), to refine among a wide node's children
    heads: list[ChainKey] = Field(default_factory=list, max_length=15)
    heads_at: int = Field(default=0, ge=0, le=MAX_LOOKUP_KEYS)

    @field_validator("steps")
    @classmethod
    def _whole_steps(cls, steps: list[str]) -> list[str]:
        import base64

        for one in steps:
            if len(base64.b64decode(one)) % 4:
                raise ValueError("each steps entry holds whole 4-byte key prefixes")
        return steps

    def step_bytes(self) -> list[bytes]:
        """``steps`` decoded: per chunk, its 4-byte key prefixes one after another."""
        import base64

        return [base64.b64decode(one) for one in self.steps]


class OrgRequest(Strict):
    org_slug: str


class VerifyRequest(Strict):
    api_key: str | None = None
