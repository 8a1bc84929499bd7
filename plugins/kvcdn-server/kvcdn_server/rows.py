"""The artifacts table's vocabulary: its states, the object keys and what callers are shown.

Object keys are chosen by the server from the artifact's random id only (never the client's name
nor anything derived from the owner)::

    uploads/<id>     bytes as uploaded, before confirm (never served)
    artifacts/<id>   the confirmed artifact

State is never inferred from object listings: the rows say what exists (docs/hosted-api.md has
the state machine, :mod:`kvcdn_server.uploads` moves it).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

#: states that hold a quota reservation
LIVE = ("pending", "uploading", "uploaded", "confirming", "ready")
#: states an upload can be PUT or confirmed from
OPEN = ("pending", "uploaded")


def now_iso(ts: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(ts if ts is not None else time.time(), dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def upload_key(artifact_id: str) -> str:
    return f"uploads/{artifact_id}"


def artifact_key(artifact_id: str) -> str:
    return f"artifacts/{artifact_id}"


def view(row, owner: bool = True) -> dict[str, Any]:
    """The fields callers see; ``owner=False`` (someone else's public artifact) hides the owner.

    Besides its own fields each entry carries the fields the original kvcdn client lists
    (``dtype``, ``num_tokens``, ...), read from the artifact's manifest; never ``id`` or
    ``model_name``, which that client takes as aliases of ``artifact_id`` and ``name`` and refuses
    when both are present.
    """
    manifest = json.loads(row.manifest) if row.manifest else None
    out = {
        "artifact_id": row.id,
        "name": row.name,
        "visibility": row.visibility,
        "status": "pending" if row.status in ("uploading", "uploaded") else row.status,
        "size_bytes": row.size_bytes,
        "sha256": row.sha256,
        "created_at": now_iso(row.created_at),
        "confirmed_at": now_iso(row.confirmed_at) if row.confirmed_at else None,
        # the same instant to the microsecond: orders artifacts confirmed within one second
        "confirmed_at_unix": round(row.confirmed_at, 6) if row.confirmed_at else None,
        "manifest": manifest,
    }
    if owner:
        out["customer_id"] = row.tenant
    m = manifest or {}
    out.update(
        dtype=m.get("dtype"),
        storage_dtype=m.get("dtype"),
        num_tokens=m.get("tokens"),
        num_layers=m.get("layers"),
        quantized=bool(m.get("quantization")),
        chunked=getattr(row, "record", None) is not None,
    )
    return out
