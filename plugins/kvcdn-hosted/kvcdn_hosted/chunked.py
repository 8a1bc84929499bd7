"""Upload and download of chunked artifacts through the hosted service (docs/hosted-api.md).

The upload cuts the `.kv` file as core's chunk store does (:mod:`kvcdn_core.store.pack`), sends
the record, PUTs only the objects the server answers missing for this tenant, and confirms; the
server rebuilds and checks the file. Given a ``reuse`` function (:func:`stored_prefix`: one prefix
lookup and one record read), a chunk that starts inside the partial last chunk of the caller's best
matching artifact is built on that chunk's stored pieces, as core's ``ChunkStore.put`` does, so a
conversation saved at every turn keeps each turn's history once. The download reads the record and rebuilds the file from one
GET per object, each checked against its BLAKE3 digest as it arrives, then the file's sha256.

``http`` is an :class:`httpx.Client` (or anything with its ``post``/``put``/``get``); ``base`` and
``headers`` address the server and carry the credential. Signed URLs carry their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvcdn_wire as wire
from kvcdn_core import KvcdnError


@dataclasses.dataclass
class ChunkedReport:
    artifact_id: str
    file_bytes: int
    objects: int
    #: object bytes sent (PUT) or fetched (GET)
    bytes_moved: int
    #: object bytes not sent because the server held them for this tenant (or the artifact
    #: repeats an object)
    bytes_saved: int
    #: the artifact's record and the digests this transfer moved (``kvcdn store`` counts chunks by
    #: them); not part of :meth:`as_dict`
    record: Any = dataclasses.field(default=None, repr=False)
    moved: frozenset[str] = frozenset()

    def as_dict(self) -> dict[str, Any]:
        skip = ("record", "moved")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


def _answer(response, what: str) -> dict[str, Any]:
    if response.status_code >= 400:
        try:
            message = response.json().get("message") or response.text
        except ValueError:
            message = response.text
        raise KvcdnError(f"{what} failed ({response.status_code}): {str(message).splitlines()[0][:300]}")
    return response.json()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def upload(
    http,
    base: str,
    headers: dict[str, str],
    path: Path,
    name: str,
    visibility: str = "private",
    chunk_tokens: int | None = None,
    replace: bool = False,
    reuse: Callable[[Any, list[int]], dict[int, tuple[Any, ...]]] | None = None,
    settled: int | None = None,
) -> ChunkedReport:
    """Upload the `.kv` file at ``path`` by chunks as ``name``; the report of what moved.

    ``replace``: the confirm also deletes the caller's other artifacts of this name. ``reuse(cutter,
    token_ids)``: the stored pieces the plan may build on (:func:`stored_prefix`); none without it.
    ``settled``: the last chunk's new bytes cut into two pieces there (:meth:`pack.Cutter.plan`)."""
    from kvcdn_core import artifact
    from kvcdn_core.store import keys, pack
    from kvcdn_core.store.record import NAME

    path = Path(path)
    header = artifact.read_header(path)
    ids = artifact.read_token_ids(path, header)
    cutter = pack.Cutter(header, ids, chunk_tokens or keys.CHUNK_TOKENS)
    cutter.check_digests()
    # the server says which objects it holds only once it has the record: a chunk whose pieces
    # match is built on them even when its whole bytes are stored too (both are exact)
    plan = cutter.plan(reuse(cutter, ids) if reuse else {}, lambda _digest: False, settled)
    stem = pack.file_stem(path)
    record = pack.record_for(stem if NAME.fullmatch(stem) else "artifact", path, header, cutter, plan)
    body = {"name": name, "sha256": _sha256(path), "visibility": visibility, "record": record.to_dict()}
    grant = _answer(http.post(f"{base}{wire.CHUNKED_UPLOAD}", json=body, headers=headers), "chunked upload")
    blobs = {b.digest: b for b in plan.blobs}
    moved = 0
    for item in grant["missing"]:
        blob = blobs[item["digest"]]
        data = pack.checked(blob.gather(), blob.digest, blob.size, str(path))
        _answer(http.put(item["url"], content=data, headers=grant["headers"]), f"PUT of object {blob.digest[:12]}")
        moved += len(data)
    artifact_id = grant["artifact_id"]
    route = f"{base}{wire.path(wire.CONFIRM_UPLOAD, artifact_id=artifact_id)}"
    _answer(http.post(route, headers=headers, json={"replace": True} if replace else None), "confirm")
    total = sum(b.size for b in plan.blobs)
    sent = frozenset(item["digest"] for item in grant["missing"])
    return ChunkedReport(artifact_id, header.file_size, grant["objects"], moved, total - moved, record, sent)


def stored_prefix(storage, cutter, ids: list[int]) -> dict[int, tuple[Any, ...]]:
    """The pieces a new upload may build on: the parts of each chunk of the caller's artifact that
    shares the longest prefix with ``ids`` (one ``/prefix/lookup``, which answers only artifacts the
    caller may read, then that artifact's record), for each chunk that starts inside the prefix
    (:func:`kvcdn_core.store.chunkstore.prefix_parts`; :meth:`pack.Cutter.plan` checks their digests
    against the file's rows). ``storage`` is a :class:`kvcdn_hosted.storage.HostedStorage`.

    Only on the service's chain (its lookup's chunk size); a failed lookup or record read, or a hit
    uploaded whole, only means no reuse: the chunks are sent whole, as they would be without it."""
    import kvcdn_wire as wire
    from kvcdn_core.store import chunkstore, keys

    if not cutter.chain or cutter.chunk_tokens != keys.CHUNK_TOKENS:
        return {}
    query = ids[: wire.MAX_LOOKUP_KEYS * keys.CHUNK_TOKENS]  # a longer file reuses within that
    try:
        hits = storage.prefix_lookup(cutter.root, query, 0, 4)
        best = max(hits, key=lambda h: h.prefix_tokens, default=None)
        if best is None or not best.ref:
            return {}
        found = storage.hit_chunks(best)
    except KvcdnError:
        return {}
    return chunkstore.prefix_parts(cutter, found[0] if found else None, best.prefix_tokens)


def download(
    http,
    base: str,
    headers: dict[str, str],
    artifact_id: str,
    target: Path,
    get: Callable[[str], bytes | memoryview | None] | None = None,
) -> ChunkedReport:
    """Rebuild chunked artifact ``artifact_id`` as the `.kv` file ``target`` (atomically).

    ``get(url)`` reads an object's signed URL, None when it answers 403/404/410 (the client's
    :class:`kvcdn_hosted.objects.ObjectReader`, which reads bodies with less CPU than httpx);
    without it the GETs go through ``http``."""
    from kvcdn_core.store import pack
    from kvcdn_core.store.record import ArtifactRecord

    route = wire.path(wire.ARTIFACT_CHUNKS, artifact_id=artifact_id)
    grant = _answer(http.post(f"{base}{route}", headers=headers), "chunked download")
    import json

    record = ArtifactRecord.from_json(json.dumps(grant["record"]).encode(), f"artifact {artifact_id}")
    urls = {o["digest"]: o["url"] for o in grant["objects"]}
    moved = 0

    def fetch(digest: str, size: int) -> bytes | memoryview:
        nonlocal moved
        if digest not in urls:
            raise KvcdnError(f"artifact {artifact_id}: the server gave no URL for object {digest}")
        data = get(urls[digest]) if get is not None else _get(http, urls[digest])
        if data is None:
            raise KvcdnError(f"artifact {artifact_id}: object {digest[:12]} is no longer served")
        moved += len(data)
        return pack.checked(data, digest, size, f"artifact {artifact_id}")

    target = Path(target)
    pack.rebuild(record, fetch, target)
    if _sha256(target) != grant["sha256"]:
        target.unlink(missing_ok=True)
        raise KvcdnError(f"artifact {artifact_id}: the rebuilt file does not match its sha256")
    return ChunkedReport(artifact_id, record.size, len(urls), moved, record.stored_bytes - moved, record)


def _get(http, url: str) -> bytes | None:
    response = http.get(url)
    if response.status_code in (403, 404, 410):
        return None
    if response.status_code != 200:
        raise KvcdnError(f"GET of a chunk failed ({response.status_code})")
    return response.content
