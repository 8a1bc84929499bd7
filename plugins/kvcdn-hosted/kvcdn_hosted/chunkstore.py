"""``kvcdn store`` on the hosted endpoint: the chunk-store operations through the chunk routes.

The server keeps every chunk once for all tenants and decides which the caller must send
(docs/hosted-api.md, "Chunked artifacts"), so this store is a thin view: a name is a hosted
artifact's name in the caller's tenant, ``put`` is a chunked upload, ``get`` a chunked download
(a whole-file artifact downloads whole), ``ls`` and ``inspect`` read the records of the caller's
chunked artifacts. The reports are core's (:mod:`kvcdn_core.store.chunkstore`), so the commands
render both stores alike. The server checks every object at confirm and collects unreferenced ones
itself, so ``check`` and ``gc`` are refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvcdn_core import KvcdnError
from kvcdn_core.store import chunkstore
from kvcdn_core.store.chunkstore import GetReport, Listed, PutReport
from kvcdn_core.store.record import ArtifactRecord

SERVER_OWNS = (
    "the hosted service checks every chunk against its digest when an upload is confirmed and "
    "collects unreferenced chunks itself; kvcdn store {what} is for a store kept on a backend of bytes"
)


class HostedChunkStore:
    """The chunk-store operations of :class:`kvcdn_core.store.chunkstore.ChunkStore` on a
    :class:`kvcdn_hosted.storage.HostedStorage`."""

    def __init__(self, storage):
        self.storage = storage

    def _artifact(self, name: str):
        chunkstore.check_name(name)
        found = self.storage._current(name)
        if found is None:
            raise KvcdnError(f"no artifact '{name}' on {self.storage.client.api_url}")
        return found

    def record(self, name: str) -> ArtifactRecord:
        found = self._artifact(name)
        if not found.chunked:
            raise KvcdnError(f"artifact '{name}' was uploaded whole, not by chunks: it has no chunks to show")
        return self._named_record(found)

    def _named_record(self, found) -> ArtifactRecord:
        # the record names the file it was cut from; the store shows the hosted name
        import dataclasses

        return dataclasses.replace(self.storage.chunk_record(found.artifact_id), name=found.name)

    def records(self, on_error=None) -> list[ArtifactRecord]:
        """The records of the caller's ready chunked artifacts (the newest of each name)."""
        newest: dict[str, Any] = {}
        for a in self.storage.artifacts():
            if a.status == "ready" and a.chunked:
                if a.name not in newest or (a.confirmed_at_unix or 0.0) > (newest[a.name].confirmed_at_unix or 0.0):
                    newest[a.name] = a
        return [self._named_record(newest[name]) for name in sorted(newest)]

    def put(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        force: bool = False,
        settled: int | None = None,
    ) -> PutReport:
        """Upload the `.kv` file by chunks as ``name`` (default: its stem), sending only the chunks
        the server does not hold for the caller, a chunk built on the stored pieces of the caller's
        best matching artifact where they match; ``force`` replaces the caller's artifact of that
        name; ``settled`` as for core's :meth:`~kvcdn_core.store.chunkstore.ChunkStore.put`."""
        from kvcdn_core.store import pack

        path = Path(path)
        name = chunkstore.check_name(name if name is not None else pack.file_stem(path))
        if not force and self.storage._current(name) is not None:
            raise KvcdnError(f"artifact '{name}' exists in the store; pass --force to replace it")
        report = self.storage.upload_chunked(path, name, replace=force, settled=settled)
        record = report.record
        new = sum(1 for c in record.chunks if any(p.digest in report.moved for p in c.parts))
        chunks = len(record.chunks)
        pieced = sum(1 for c in record.chunks if c.pieces)
        return PutReport(
            name,
            record.token_count,
            record.size,
            chunks,
            new,
            chunks - new,
            pieced,
            report.bytes_moved,
            report.bytes_saved,
        )

    def get(self, name: str, target: str | os.PathLike[str]) -> GetReport:
        """Rebuild artifact ``name`` as the `.kv` file ``target``, every object checked as it
        arrives (a whole-file artifact: downloaded whole, checked against its sha256)."""
        found = self._artifact(name)
        if found.chunked:
            report = self.storage.download_chunked(found.artifact_id, Path(target))
            return GetReport(name, str(target), report.file_bytes, report.bytes_moved)
        self.storage.download(found.artifact_id, Path(target))
        return GetReport(name, str(target), found.size_bytes, found.size_bytes)

    def delete(self, name: str) -> ArtifactRecord:
        """Delete the caller's artifacts called ``name``; the server collects chunks nobody references."""
        record = self.record(name)
        self.storage.delete(name)
        return record

    def listing(self, on_error=None) -> list[Listed]:
        return chunkstore.listed(self.records())

    def chunk_table(self, name: str):
        record = self.record(name)
        others = [r for r in self.records() if r.name != name]
        return record, chunkstore.chunk_rows(record, others)

    def check(self, now: float | None = None):
        raise KvcdnError(SERVER_OWNS.format(what="check"))

    def rebuild_index(self) -> int:
        raise KvcdnError(SERVER_OWNS.format(what="check --repair"))

    def gc(self, now: float | None = None):
        raise KvcdnError(SERVER_OWNS.format(what="gc"))
