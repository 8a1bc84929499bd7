"""The hosted endpoint as a kvcdn storage backend, and the hosted API calls behind it.

URIs: ``kvcdn://`` (the configured ``api_url``) or ``kvcdn+https://host[:port]`` /
``kvcdn+http://host[:port]`` (that endpoint). Credentials come from the usual settings (env,
config, stored login).

As a :class:`~kvcdn_core.StorageBackend`, a key is an artifact's *name* in the caller's own tenant
(what ``kvcdn upload --name`` gives; ``team/doc.kv`` lists under the prefix ``team/``):

- ``put_file`` uploads and, in the same server-side step as the confirm, deletes the tenant's other
  artifacts of that name (``replace``): a name holds one object, and of racing writers the last
  one confirmed stays. The upload gets a new artifact id.
- reads and ``list`` see the tenant's ready artifacts; a name that several artifacts share
  (uploaded with ``kvcdn upload`` without replacing) reads as the one confirmed last, and
  ``delete`` removes all of them.
- ``stores = "kv"``: the server checks every upload, so only valid ``.kv`` artifacts are taken;
  anything else is refused with :class:`~kvcdn_core.NotSupported` before a request is made.
- ``rename`` is not offered (``unsupported``): the API has none, and copy plus delete would give
  the artifact a new id and break every reference to the old one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal
from urllib.parse import urlparse

import kvcdn_wire as wire
from kvcdn_core import (
    ArtifactError,
    KvcdnError,
    NotSupported,
    ObjectInfo,
    ObjectNotFound,
    StorageBackend,
    check_prefix,
    safe_key,
)

if TYPE_CHECKING:
    from kvcdn_wire.responses import ArtifactRecord, DownloadGrant, InferAnswer, Multipart

#: confirm makes the server read and hash the whole object: allow a floor plus time per byte
CONFIRM_BASE_S = 60.0
CONFIRM_BYTES_PER_S = 20 * (1 << 20)
CONFIRM_POLL_S = 1.0
#: how often a read resolves a name again when a concurrent replace deleted what it found
RESOLVE_ATTEMPTS = 5


def confirm_timeout(size: int) -> float:
    """Seconds to wait for a confirm of ``size`` bytes (60 s, plus 1 s per 20 MiB)."""
    return CONFIRM_BASE_S + size / CONFIRM_BYTES_PER_S


def _id(artifact_id: str) -> str:
    """An artifact id, checked non-empty (:func:`wire.path` makes it one URL path segment, never a
    way to reach another route)."""
    artifact_id = (artifact_id or "").strip()
    if not artifact_id:
        raise KvcdnError("artifact id is empty")
    return artifact_id


def _name(key: str) -> str:
    """A storage key as an artifact name: a valid key, already in the Unicode NFC the server keeps."""
    if unicodedata.normalize("NFC", safe_key(key)) != key:
        raise KvcdnError(f"invalid storage key '{key}': the hosted endpoint keeps names in Unicode NFC")
    return key


def _recency(record: ArtifactRecord) -> tuple[float, str]:
    """Orders artifacts of one name: the one confirmed last reads as the name's object (by the
    microsecond ``confirmed_at_unix``; then by id, so that ties are stable)."""
    return (record.confirmed_at_unix or 0.0, record.artifact_id)


_INCOMPLETE_SAID = threading.Event()


def _incomplete_once() -> None:
    """Say once per process that a lookup's answer could not compare every candidate."""
    if not _INCOMPLETE_SAID.is_set():
        _INCOMPLETE_SAID.set()
        logging.getLogger("kvcdn.hosted").warning(
            "prefix lookup: more stored prefixes go on past the match than one answer compares; "
            "a longer match among them may be missed (hits say complete=False)"
        )


class HostedStorage(StorageBackend):
    """Artifacts on a kvcdn hosted endpoint (``kvcdn serve``); as storage, keyed by artifact name."""

    schemes: ClassVar[tuple[str, ...]] = ("kvcdn", "kvcdn+http", "kvcdn+https")
    stores: ClassVar[str] = "kv"
    unsupported: ClassVar[frozenset[str]] = frozenset({"rename"})
    capabilities: ClassVar[frozenset[str]] = frozenset({"prefix_lookup", "chunk_store"})

    def __init__(self, settings, *, quiet: bool = True):
        self.settings = settings
        self.quiet = quiet
        self._client = None
        self._client_lock = threading.Lock()

    @classmethod
    def from_uri(cls, uri: str) -> HostedStorage:
        from kvcdn_hosted.config import load_settings

        parsed = urlparse(uri)
        if parsed.scheme == "kvcdn":
            if parsed.netloc or parsed.path.strip("/"):
                raise KvcdnError(f"'{uri}': use kvcdn:// for the configured endpoint or kvcdn+https://host")
            return cls(load_settings())
        base = parsed.scheme.removeprefix("kvcdn+") + "://" + parsed.netloc + parsed.path.rstrip("/")
        return cls(load_settings(api_url=base))

    @property
    def client(self):
        with self._client_lock:  # one client (one connection pool) for every thread
            if self._client is None:
                from kvcdn_hosted.client import HostedClient

                self._client = HostedClient(self.settings)
            return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- the hosted API ------------------------------------------------------------------------

    def upload(
        self, source: Path, name: str, visibility: Literal["private", "public"] = "private", replace: bool = False
    ) -> ArtifactRecord:
        """Upload a checked ``.kv`` file; return the confirmed artifact record.

        ``replace``: the confirm also deletes the caller's other artifacts of this name.
        """
        from kvcdn_core import artifact
        from kvcdn_hosted import transfer

        source = Path(source)
        manifest = artifact.read_header(source).manifest  # refuses a non-.kv before any request
        size = source.stat().st_size
        digest = transfer.sha256_file(source, "sha256", quiet=self.quiet)
        client = self.client
        client.require_credential("upload")
        from kvcdn_wire.requests import ManifestHints, UploadUrlRequest
        from kvcdn_wire.responses import UploadGrant

        body = UploadUrlRequest(
            name=name,
            size_bytes=size,
            sha256=digest,
            visibility=visibility,
            manifest=ManifestHints(**artifact.summary(manifest)),
        )
        grant = client.read(
            UploadGrant, "POST", wire.UPLOAD_URL, what="upload", json=body.model_dump(exclude_unset=True)
        )
        confirm_body: dict[str, Any] | None = {"replace": True} if replace else None
        if grant.multipart is not None:
            confirm_body = {**(confirm_body or {}), "parts": self._upload_parts(source, grant.multipart)}
        elif grant.url:
            transfer.put_bytes(
                client.http, client.url(grant.url), source, headers=grant.headers, label="upload", quiet=self.quiet
            )
        else:
            raise KvcdnError("upload: the server offered no PUT url")
        return self._confirm(grant.artifact_id, confirm_body, size, digest)

    def _confirm(self, artifact_id: str, body: dict | None, size: int, digest: str, again: int = 2) -> ArtifactRecord:
        """Confirm an upload; a retry that finds it already confirmed counts once the record shows it,
        and one whose confirm was handed back (an interrupted confirm: ``pending`` again) confirms
        again, ``again`` more times at most."""
        import time

        from kvcdn_hosted.client import error_code, parse_answer, raise_for_response
        from kvcdn_wire.responses import ArtifactRecord

        client = self.client
        timeout = confirm_timeout(size)
        response = client.request(
            "POST",
            wire.path(wire.CONFIRM_UPLOAD, artifact_id=_id(artifact_id)),
            what="upload confirm",
            json=body,
            ok=(200, 409),
            timeout=timeout,
            idempotent=True,
        )
        if response.status_code == 200:
            return parse_answer(ArtifactRecord, response, "upload confirm")
        if error_code(response) not in wire.CONFIRM_MAYBE_DONE:
            raise_for_response(response, "upload confirm")
        # An earlier attempt (its answer lost) confirmed it or is still checking it: wait for the record.
        deadline = time.monotonic() + timeout
        while True:
            record = self.describe(artifact_id)
            if record.status == "ready":
                if record.sha256 != digest or record.size_bytes != size:
                    raise KvcdnError(f"upload confirm: artifact {artifact_id} was confirmed with other bytes")
                return record
            if record.status == "pending" and again > 0:
                return self._confirm(artifact_id, body, size, digest, again - 1)
            if time.monotonic() > deadline:
                raise KvcdnError(
                    f"upload confirm: artifact {artifact_id} is still being checked; see `kvcdn list` in a while"
                )
            time.sleep(CONFIRM_POLL_S)

    def _upload_parts(self, source: Path, multipart: Multipart) -> list[dict[str, Any]]:
        from kvcdn_hosted import transfer

        parts = sorted(multipart.parts, key=lambda p: p.part_number)
        done = []
        for index, part in enumerate(parts):
            response = transfer.put_bytes(
                self.client.http,
                self.client.url(part.url),
                source,
                start=(part.part_number - 1) * multipart.part_size,
                length=part.size,
                label=f"upload part {index + 1}/{len(parts)}",
                quiet=self.quiet,
            )
            done.append({"part_number": part.part_number, "etag": response.headers.get("ETag", "")})  # verbatim
        return done

    def artifacts(self, page_size: int = 100, prefix: str = "") -> list[ArtifactRecord]:
        """Every artifact the credential can see (whose name starts with ``prefix``), following the
        pagination cursor."""
        from kvcdn_wire.responses import ArtifactPage

        found: list[ArtifactRecord] = []
        cursor = None
        for _ in range(10_000):
            params: dict[str, Any] = {"limit": page_size}
            if prefix:
                params["prefix"] = prefix
            if cursor:
                params["cursor"] = cursor
            page = self.client.read(ArtifactPage, "GET", wire.ARTIFACTS, what="list", params=params)
            found.extend(page.artifacts)
            cursor = page.next_cursor
            if not cursor:
                return found
        raise KvcdnError("list: the server kept returning more pages")

    def describe(self, artifact_id: str) -> ArtifactRecord:
        from kvcdn_wire.responses import ArtifactRecord

        path = wire.path(wire.ARTIFACT, artifact_id=_id(artifact_id))
        return self.client.read(ArtifactRecord, "GET", path, what=f"artifact {artifact_id}")

    def upload_chunked(
        self,
        source: Path,
        name: str,
        visibility: Literal["private", "public"] = "private",
        replace: bool = False,
        settled: int | None = None,
    ):
        """Upload a ``.kv`` file by its chunks, sending only those the server does not hold for
        this tenant (:mod:`kvcdn_hosted.chunked`), a chunk that starts inside the partial last
        chunk of the caller's best matching artifact built on its stored pieces
        (:func:`kvcdn_hosted.chunked.stored_prefix`); the report of bytes moved and saved.

        ``replace``: the confirm also deletes the caller's other artifacts of this name; ``settled``:
        the last chunk's new bytes cut there (:meth:`kvcdn_core.store.pack.Cutter.plan`)."""
        from kvcdn_hosted import chunked

        self.client.require_credential("upload")
        base = self.client.api_url.rstrip("/")
        return chunked.upload(
            self.client.http,
            base,
            self.client.headers(),
            Path(source),
            name,
            visibility,
            replace=replace,
            reuse=functools.partial(chunked.stored_prefix, self),
            settled=settled,
        )

    def chunk_record(self, artifact_id: str):
        """A chunked artifact's record (:class:`kvcdn_core.store.record.ArtifactRecord`), as its
        chunks route gives it."""
        import json

        from kvcdn_core.store.record import ArtifactRecord

        route = wire.path(wire.ARTIFACT_CHUNKS, artifact_id=_id(artifact_id))
        answer = self.client.request("POST", route, what=f"artifact {artifact_id}", idempotent=True).json()
        return ArtifactRecord.from_json(json.dumps(answer["record"]).encode(), f"artifact {artifact_id}")

    def chunk_store(self):
        """The chunk-store operations on this endpoint (:mod:`kvcdn_hosted.chunkstore`)."""
        from kvcdn_hosted.chunkstore import HostedChunkStore

        return HostedChunkStore(self)

    def download_chunked(self, artifact_id: str, target: Path):
        """Rebuild a chunked artifact from its objects, each checked as it arrives."""
        from kvcdn_hosted import chunked

        base = self.client.api_url.rstrip("/")
        return chunked.download(
            self.client.http, base, self.client.headers(), _id(artifact_id), Path(target), self.client.objects.get
        )

    def download_grant(self, artifact_id: str) -> DownloadGrant:
        from kvcdn_wire.responses import DownloadGrant

        # public artifacts need no credential: send one only when we have it
        return self.client.read(
            DownloadGrant,
            "POST",
            wire.path(wire.DOWNLOAD_URL, artifact_id=_id(artifact_id)),
            what=f"download {artifact_id}",
            idempotent=True,
        )

    def download(self, artifact_id: str, target: Path) -> Path:
        return self._fetch(self.download_grant(artifact_id), Path(target))

    def _fetch(self, grant: DownloadGrant, target: Path) -> Path:
        """Download what a download-url answer grants, checked by size and sha256, atomically."""
        from kvcdn_hosted import transfer

        return transfer.download_to(
            self.client.http,
            self.client.url(grant.download_url),
            Path(target),
            sha256=grant.sha256,
            size=grant.size_bytes,
            label="download",
            quiet=self.quiet,
        )

    def remove(self, artifact_id: str) -> None:
        self.client.request(
            "DELETE",
            wire.path(wire.ARTIFACT, artifact_id=_id(artifact_id)),
            what=f"delete {artifact_id}",
            ok=(200, 204),
        )

    def infer(
        self,
        artifact_id: str,
        question: str,
        n: int,
        org: str | None = None,
        project: str | None = None,
        compose: list[str] | None = None,
        recompute: float | None = None,
        select: str | None = None,
    ) -> InferAnswer:
        """Continue from ``artifact_id``; with ``compose``, from it and those artifacts' documents in
        that order (``recompute`` and ``select`` left out take the server's defaults, the local ones)."""
        from kvcdn_wire.responses import InferAnswer

        if org and project:
            path = wire.path(wire.LEGACY_INFER, org=org, project=project, artifact_id=_id(artifact_id))
        else:
            path = wire.path(wire.INFER, artifact_id=_id(artifact_id))
        body: dict = {"question": question, "n": n}  # the server checks the limits (its own may be lower)
        if compose:
            body["compose"] = [_id(one) for one in compose]
        for field, value in (("recompute", recompute), ("select", select)):
            if value is not None:
                body[field] = value
        # no side effects: a retry only repeats the work
        return self.client.read(InferAnswer, "POST", path, what="infer", json=body, timeout=600.0, idempotent=True)

    # -- prefix_lookup: the server's index, asked by chain keys ---------------------------------

    def prefix_roots(self) -> list[dict[str, Any]]:
        from kvcdn_wire.responses import PrefixRoots

        answer = self.client.read(PrefixRoots, "GET", wire.PREFIX_ROOTS, what="prefix roots")
        return [r.model_dump() for r in answer.roots]

    def prefix_lookup(self, root: str, query_ids, start_tokens: int, limit: int) -> list[Any]:
        """The server's matches for the query's chain keys (its token ids never leave this process),
        refined to the token here (:func:`kvcdn_core.store.index.from_matches`), in one request:
        the server finds how many whole chunks match and sends back the candidates that go on,
        with their token ids in the next chunk."""
        return self._ask(root, query_ids, start_tokens, limit, grant=False)[0]

    def prefix_lookup_grant(
        self,
        root: str,
        query_ids,
        limit: int = 1,
        held: Callable[[list[str]], list[str]] | None = None,
        impatient: bool = False,
    ) -> tuple[list[Any], Any]:
        """:meth:`prefix_lookup` that also asks for the best match's chunk grant in the same
        request: the hits, and the match the server ranked best as ``(artifact_id, grant)``, where
        ``grant`` is ``(record, URL per digest, expiry)`` (``record`` None: stored whole), or None
        when it is one of the ids ``held`` returned (called with the query's full-chunk keys: the
        grants the caller keeps and may use again); or None for no match. The caller checks the
        artifact is the hit it wants. ``impatient``: one attempt, waiting at most
        ``IMPATIENT_TIMEOUT_S`` (a caller for whom a miss is cheaper than a wait: the engine's
        scheduler); a timeout raises :class:`~kvcdn_hosted.client.ServiceTimeout`."""
        return self._ask(root, query_ids, 0, limit, grant=True, held=held, impatient=impatient)

    def _ask(
        self, root: str, query_ids, start_tokens: int, limit: int, grant: bool, held=None, impatient: bool = False
    ) -> tuple[list[Any], Any]:
        import base64
        from types import SimpleNamespace

        import numpy as np

        from kvcdn_core.store import index, keys
        from kvcdn_hosted import client as client_module
        from kvcdn_wire.responses import PrefixLookup

        ids = np.asarray(query_ids, dtype=np.int64)
        full = keys.full_chain(root, ids)
        if len(full) > wire.MAX_LOOKUP_KEYS:
            raise KvcdnError(
                f"lookup: the query has {len(full)} chunks; the server looks up at most {wire.MAX_LOOKUP_KEYS}"
            )
        c, blocks, steps = keys.CHUNK_TOKENS, [], []
        for i, parent in enumerate([root, *full]):
            chunk = ids[i * c : (i + 1) * c]
            block = keys.first_block(parent, chunk)
            if block is None:
                break
            blocks.append(block)
            if grant:
                steps.append(base64.b64encode(keys.steps(parent, chunk)).decode())
        body = {"root": root, "keys": full, "blocks": blocks, "limit": min(max(limit, 1), wire.MAX_LOOKUP_LIMIT)}
        if grant:
            body.update(grant=True, steps=steps)
            if held is not None:
                body["held"] = held(full)[:16]
        # impatient: one attempt, a short wait (kept out of the call otherwise, so the plain lookup
        # is the two-argument call a test may stand in for)
        patience = {"attempts": 1, "timeout": client_module.IMPATIENT_TIMEOUT_S} if impatient else {}
        answer = self._lookup(PrefixLookup, body, **patience)
        depth = answer.matched_chunks
        if not answer.complete and not grant and 0 <= depth <= len(full):
            # a wide node's children, none sharing the next 16 tokens: ask again with the keys of
            # the query's first 1 to 15 tokens there (a rare second request; the engine's lookup,
            # which loads whole blocks of 16 or more, has no use for it)
            chunk_heads = keys.heads(full[depth - 1] if depth else root, ids[depth * c : (depth + 1) * c])
            if chunk_heads:
                body.update(heads=[h.hex() for h in chunk_heads], heads_at=depth)
                answer = self._lookup(PrefixLookup, body)
        try:
            matches = [SimpleNamespace(**m.model_dump(), next_tokens=answer.next_tokens(m)) for m in answer.matches]
            granted = None
            if answer.grant is not None:
                g = answer.grant
                granted = (g.artifact_id, None if g.held else self._grant_of(g.record, g.objects, g.expires_at))
        except (IndexError, ValueError, TypeError, KeyError) as e:
            raise KvcdnError(f"prefix lookup: the server's answer does not parse ({e})") from None
        hits = index.from_matches(matches, root, ids, start_tokens, limit)
        # still incomplete: more than 32 children share the next 16 tokens (or, asked with a grant,
        # with no second request: none does, and a match under 16 more tokens is of no use there)
        shared = any(h.prefix_tokens >= answer.matched_chunks * c + keys.BLOCK_TOKENS for h in hits)
        if not answer.complete and (shared or not grant):
            _incomplete_once()
            hits = [dataclasses.replace(h, complete=False) for h in hits]
        return hits, granted

    def _grant_of(self, record: dict | None, objects, expires_at: str) -> tuple[Any, dict[str, str], float]:
        """A chunk grant's record (None: stored whole), URL per digest, and expiry (Unix seconds)."""
        import datetime as dt
        import json

        from kvcdn_core.store.record import ArtifactRecord as ChunkRecord

        parsed = None if record is None else ChunkRecord.from_json(json.dumps(record).encode(), "a chunk grant")
        expires = dt.datetime.strptime(expires_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
        urls = {}
        for o in objects:
            digest, url = (o["digest"], o["url"]) if isinstance(o, dict) else (o.digest, o.url)
            urls[digest] = self.client.url(url)
        return parsed, urls, expires.timestamp()

    def _lookup(self, model, body: dict[str, Any], **patience):
        return self.client.read(
            model, "POST", wire.PREFIX_LOOKUP, what="prefix lookup", json=body, idempotent=True, **patience
        )

    def fetch_hit(self, hit: Any, target: Path) -> None:
        """The artifact a lookup found, by its id (not its name: a public one is another tenant's)."""
        self.download(hit.ref, Path(target))

    def hit_chunks(self, hit: Any) -> tuple[Any, dict[str, str], float] | None:
        """A hit's chunk record, a signed GET URL per object and when they expire (one request to the
        artifact's chunks route); None for an artifact uploaded whole (the route answers 422 for it)."""
        from kvcdn_hosted.client import raise_for_response

        route = wire.path(wire.ARTIFACT_CHUNKS, artifact_id=_id(hit.ref))
        response = self.client.request("POST", route, what="artifact chunks", ok=(200, 422), idempotent=True)
        if response.status_code == 422:
            if "stored whole" in response.text:
                return None
            raise_for_response(response, "artifact chunks")
        grant = response.json()
        return self._grant_of(grant["record"], grant["objects"], grant["expires_at"])

    def read_chunk(
        self, location: str, into: memoryview | None = None, landed: Callable[[int], None] | None = None
    ) -> bytes | memoryview | None:
        """One object through its signed URL (the URL carries its own credential), its body read
        into ``into`` as it arrives when given, ``landed`` told how much is in place
        (:mod:`kvcdn_hosted.objects`: no piece copied on the way)."""
        return self.client.objects.get(location, into, landed)

    # -- StorageBackend: keys are artifact names -----------------------------------------------

    def _named(self, key: str) -> list[ArtifactRecord]:
        """The caller's ready artifacts called ``key``, the one confirmed last first."""
        _name(key)
        found = [a for a in self.artifacts(prefix=key) if a.name == key and a.status == "ready"]
        return sorted(found, key=_recency, reverse=True)

    def _current(self, key: str) -> ArtifactRecord | None:
        named = self._named(key)
        return named[0] if named else None

    def put_file(self, key: str, source: Path) -> None:
        from kvcdn_core import artifact

        _name(key)
        try:
            artifact.read_header(source)
        except ArtifactError as exc:
            raise NotSupported(f"the hosted endpoint stores only .kv artifacts: {exc}") from None
        self.upload(Path(source), name=key, replace=True)

    def get_file(self, key: str, target: Path) -> None:
        """The artifact called ``key``, checked against its sha256, written atomically to ``target``."""
        from kvcdn_hosted.client import parse_answer
        from kvcdn_wire.responses import DownloadGrant

        for _ in range(RESOLVE_ATTEMPTS):
            record = self._current(key)
            if record is None:
                break
            response = self.client.request(
                "POST",
                wire.path(wire.DOWNLOAD_URL, artifact_id=_id(record.artifact_id)),
                what=f"download {key}",
                ok=(200, 404),
                idempotent=True,
            )
            if response.status_code == 404:
                continue  # replaced or deleted since it was listed: look the name up again
            self._fetch(parse_answer(DownloadGrant, response, f"download {key}"), Path(target))
            return
        raise ObjectNotFound(f"no artifact named '{key}' on {self.client.api_url}")

    def open_read(self, key: str):
        """The artifact, downloaded and checked against its sha256 before anything is read from it."""
        return super().open_read(key)

    def size_of(self, key: str) -> int | None:
        record = self._current(key)
        return None if record is None else record.size_bytes

    def delete(self, key: str) -> None:
        for record in self._named(key):
            self.client.request(
                "DELETE",
                wire.path(wire.ARTIFACT, artifact_id=_id(record.artifact_id)),
                what=f"delete {key}",
                ok=(200, 204, 404),  # 404: a concurrent delete or replace got there first
            )

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        newest: dict[str, ArtifactRecord] = {}
        for a in self.artifacts(prefix=check_prefix(prefix)):
            if a.name.startswith(prefix) and a.status == "ready":
                if a.name not in newest or _recency(a) > _recency(newest[a.name]):
                    newest[a.name] = a
        return [ObjectInfo(name, newest[name].size_bytes) for name in sorted(newest)]
