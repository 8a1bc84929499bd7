"""Garbage collection: reclaim what the database says is dead, and nothing else.

Apart from the state machine because it is the one part that runs on its own (a thread of every
replica, ``app.collector``) and judges leases rather than holding them: it expires open uploads,
hands back work whose server stopped, and deletes objects and temp files that no live row owns.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import sqlalchemy as sa

from kvcdn_server.db import artifacts
from kvcdn_server.rows import LIVE, OPEN
from kvcdn_server.uploads import TEMP_OWNER, Uploads

#: how long rows of failed/expired uploads stay, so that a client's retry learns what happened
KEEP_DEAD_ROWS = 86400
#: what creating a secret file at start-up leaves in the server's home if the process dies
#: mid-write (``config._secret_file``)
SECRET_TEMP = re.compile(r"\.(api-key-seed|admin-secret|url-signing-key)\.[0-9a-f]{8}\.tmp")


class Collector:
    """The collector of one store (its clock, database, storage and temp files)."""

    def __init__(self, store: Uploads):
        self.store = store

    def collect(self, now: float | None = None) -> dict[str, int]:
        """Reclaim what the database says is dead; return counts of what went.

        - open uploads whose session expired → ``expired`` (reservation released, bytes removed);
        - PUTs and confirms whose lease ran out (their server died, or could not reach the database)
          are handed back: a PUT's upload to ``pending``, a confirm's to ``uploaded`` with its bytes
          (once: a confirm interrupted a second time → ``failed``, reservation released, bytes
          removed). Not for a lease period after this process last failed to reach the database,
          so that live holders renew their leases first;
        - objects under ``uploads/`` and ``artifacts/`` whose row is gone or dead, temp files (of
          PUTs, and copies of S3 objects) no live work holds, and S3 multipart uploads no open
          upload owns, older than the orphan grace period;
        - chunk objects that no artifact (ready, or a live upload) references
          (:meth:`kvcdn_server.chunks.ChunkObjects.collect`);
        - rows of failed/expired uploads after a day (until then a retry learns what happened).

        ``now``: the clock (tests pass one instead of waiting).
        """
        now = self.store.clock() if now is None else now
        counts = {
            "expired": 0,
            "handed_back": 0,
            "failed": 0,
            "objects": 0,
            "temp_files": 0,
            "multipart": 0,
            "rows": 0,
            "chunks": 0,
        }
        due_when = [sa.and_(artifacts.c.status.in_(OPEN), artifacts.c.expires_at < now)]
        if self.store.judging_leases(now):
            due_when.append(sa.and_(artifacts.c.status.in_(("uploading", "confirming")), artifacts.c.lease_until < now))
        with self.store.reads.connect() as c:
            due = c.execute(sa.select(artifacts.c.id, artifacts.c.status).where(sa.or_(*due_when))).all()
        for artifact_id, status in due:
            if status in OPEN:
                counts["expired"] += self.store.end(artifact_id, OPEN, "expired")
            else:
                outcome = self.store.reclaim(artifact_id, status, now)
                if outcome:
                    counts[outcome] += 1
        # chunk objects no artifact references any more (after the expiries above dropped theirs)
        counts["chunks"] = self.store.objects.collect()
        grace = self.store.config.orphan_grace
        for prefix in ("uploads/", "artifacts/"):
            keys = [info.key for info in self.store.storage.list(prefix)]
            ids = [k[len(prefix) :] for k in keys]
            alive = self._alive(
                ids,
                # an upload handed back by an interrupted confirm keeps its bytes under artifacts/
                ("pending", "uploading", "uploaded", "confirming") if prefix == "uploads/" else LIVE,
            )
            for key, artifact_id in zip(keys, ids):
                if artifact_id not in alive and self._dead_long_enough(artifact_id, now - grace):
                    self.store.storage.delete(key)
                    counts["objects"] += 1
        counts["temp_files"] = self._sweep_temp(now - grace, now)
        counts["multipart"] = self._abort_orphan_multiparts(now - grace)
        with self.store.db.begin() as c:
            counts["rows"] = c.execute(
                artifacts.delete().where(
                    artifacts.c.status.in_(("failed", "expired")), artifacts.c.updated_at < now - KEEP_DEAD_ROWS
                )
            ).rowcount
        return counts

    def _alive(self, ids: list[str], states: tuple[str, ...]) -> set[str]:
        alive: set[str] = set()
        with self.store.reads.connect() as c:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                alive.update(
                    c.execute(
                        sa.select(artifacts.c.id).where(artifacts.c.id.in_(chunk), artifacts.c.status.in_(states))
                    ).scalars()
                )
        return alive

    def _dead_long_enough(self, artifact_id: str, before: float) -> bool:
        row = self.store.row(artifact_id)
        return row is None or row.updated_at < before

    def _abort_orphan_multiparts(self, before: float) -> int:
        """Multipart uploads (S3) that no open upload row names: a crash between starting one and
        recording it, or an upload that ended while its abort failed."""
        if not type(self.store.storage).offers("multipart"):
            return 0
        aborted = 0
        for key, multipart_id in self.store.storage.list_multipart("uploads/"):
            row = self.store.row(key[len("uploads/") :])
            owned = (
                row is not None
                and row.status in OPEN + ("uploading", "confirming")
                and row.multipart_id == multipart_id
            )
            if not owned and (row is None or row.updated_at < before):
                self.store.storage.abort_multipart(key, multipart_id)
                aborted += 1
        return aborted

    def _sweep_temp(self, before: float, now: float) -> int:
        """Remove temp files left by work that stopped (a crash mid-PUT or mid-confirm).

        Where they are: ``.put-*`` next to the objects (local storage), everything in the server's
        tmp dir (``.put-*``, ``.copy-*``, and what an older version left there), and a secret's
        temp file in the server's home (a crash while it was created). One is
        removed when nothing in it changed since ``before`` (the orphan grace), no work of this
        process uses it, and its upload holds no live lease for the work that made it (a PUT, a
        confirm: another replica may be doing it).
        """
        places = {self.store.tmp_dir: True, Path(self.store.config.home): False}
        places.setdefault(self.store.temp_dir(), False)
        removed = 0
        for directory, everything in places.items():
            try:
                entries = list(directory.iterdir())
            except FileNotFoundError:
                continue
            for path in entries:
                prefix = next((p for p in TEMP_OWNER if path.name.startswith(p)), None)
                if prefix is None and not everything and not SECRET_TEMP.fullmatch(path.name):
                    continue
                if self.store.in_use(path):
                    continue
                if prefix is not None:
                    row = self.store.row(path.name[len(prefix) : len(prefix) + 36])
                    if row is not None and row.status == TEMP_OWNER[prefix] and (row.lease_until or 0) >= now:
                        continue
                changed = last_change(path)
                if changed is None or changed >= before:
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed += 1
        return removed


def last_change(path: Path) -> float | None:
    """The newest modification time of ``path`` and, for a directory, of everything in it (a copy
    being downloaded changes inside its directory); None when it is gone."""
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            for root, dirs, files in os.walk(path):
                for name in dirs + files:
                    with contextlib.suppress(FileNotFoundError):
                        newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    except FileNotFoundError:
        return None
    return newest
