"""What an upload must be: the checks of names and declared facts at upload-url, and of the bytes
at confirm (size, sha256, a valid ``.kv`` whose manifest agrees with what was declared).

Kept apart from the state machine (:mod:`kvcdn_server.uploads`) because these are plain answers
about bytes and strings: they change no row, so they can be read and tested on their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcdn_core import KvcdnError, StorageBackend, artifact, nfc, text_problem
from kvcdn_server.errors import ApiError, not_found
from kvcdn_server.prefix import Entry, entry_of
from kvcdn_server.rows import artifact_key, upload_key
from kvcdn_wire import ErrorCode

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
HINTS = ("model_id", "architecture", "tokens", "layers", "dtype", "quantization")


def check_id(artifact_id: str) -> str:
    """Only canonical uuid4 ids reach the store; anything else is simply not found."""
    if not isinstance(artifact_id, str) or not UUID.match(artifact_id):
        raise not_found()
    return artifact_id


def check_name(name: str) -> str:
    """The NFC form of an artifact name, or 422.

    Names keep the text rule of every shown string (:mod:`kvcdn_core.text`) and are kept in NFC,
    so the composed and decomposed spellings of a name are one name. ``/`` separates parts
    (``team/doc.kv``, the keys of the client's storage backend), and the path rules hold for the
    name's NFKC form too, which folds look-alikes such as fullwidth dots (``．．/x``) into the
    ASCII a path would be read as."""
    problem = text_problem(name)
    if problem is None:
        name = nfc(name)
        problem = text_problem(name)  # normalising can bring a combining mark to the front
    if problem is None and not 1 <= len(name) <= 255:
        problem = "be 1 to 255 characters"
    if problem is None and name != name.strip():
        problem = "not start or end with white space"
    if problem is None:
        problem = _path_problem(name) or _path_problem(unicodedata.normalize("NFKC", name))
    if problem:
        raise ApiError(422, ErrorCode.INVALID_NAME, f"artifact name must {problem}")
    return name


def _path_problem(name: str) -> str | None:
    if "\\" in name:
        return "not contain '\\' (nor a look-alike of it)"
    parts = name.split("/")
    if any(part in ("", ".") for part in parts):
        return "not start or end with '/' nor have an empty or '.' part between slashes (nor look-alikes)"
    if ".." in name:
        return "not contain '..' (nor a look-alike of it)"
    return None


def check_prefix_filter(prefix: str) -> str:
    """A listing prefix in NFC (names are stored so), or 422 when it breaks the text rule."""
    problem = text_problem(prefix)
    if problem is None and len(prefix) > 255:
        problem = "be at most 255 characters"
    if problem:
        raise ApiError(422, ErrorCode.VALIDATION_ERROR, f"prefix: must {problem}")
    return nfc(prefix)


def check_hint(field: str, value: object) -> None:
    """A declared manifest fact that is a string keeps the text rule (it is echoed in refusals)."""
    if isinstance(value, str):
        problem = text_problem(value) or (None if len(value) <= 255 else "be at most 255 characters")
        if problem:
            raise ApiError(422, ErrorCode.VALIDATION_ERROR, f"manifest.{field}: must {problem}")


def manifest_summary(header: artifact.Header) -> dict[str, Any]:
    """What listings show, read from the artifact's own header."""
    return {
        **artifact.summary(header.manifest),
        "format_version": header.format_version,
        "kvcdn_version": header.manifest.get("kvcdn_version"),
    }


class Refused(Exception):
    """The upload is wrong: it fails (422)."""

    def __init__(self, status: int, code: ErrorCode, message: str):
        super().__init__(message)
        self.error = ApiError(status, code, message)


class NotYet(Exception):
    """The upload is not complete yet: it goes back to where it was and may be confirmed later."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


def _take_bytes(storage: StorageBackend, row, parts) -> None:
    """Move the upload's bytes out of reach of its upload URL (an S3 URL stays valid), to the
    artifact key where they are checked: newly uploaded bytes, else those an interrupted confirm
    had moved already, else the parts of a multipart upload, assembled."""
    if storage.size_of(upload_key(row.id)) is None:
        if storage.size_of(artifact_key(row.id)) is not None:
            return
        if not row.multipart_id:
            raise NotYet(
                ApiError(409, ErrorCode.UPLOAD_INCOMPLETE, "no bytes have been uploaded for this artifact yet")
            )
        if not parts:
            raise NotYet(
                ApiError(409, ErrorCode.UPLOAD_INCOMPLETE, "a multipart upload is confirmed with its parts' ETags")
            )
        try:
            storage.complete_multipart(upload_key(row.id), row.multipart_id, parts)
        except Exception:
            raise Refused(422, ErrorCode.UPLOAD_INCOMPLETE, "the parts could not be assembled") from None
    storage.rename(upload_key(row.id), artifact_key(row.id))


def check_upload(
    storage: StorageBackend,
    row,
    parts: list[dict[str, Any]] | None,
    digest: str | None,
    size: int | None,
    local_copy: Callable[[str], contextlib.AbstractContextManager[Path]],
) -> tuple[dict[str, Any], Entry]:
    """Move the upload's bytes to its artifact key and check them against what was declared: the
    listing summary of a valid artifact and its prefix-index entry (read from the same copy);
    :class:`Refused` when the bytes are wrong, :class:`NotYet` when they are not all there.
    ``local_copy`` gives a local path of an object."""
    _take_bytes(storage, row, parts)
    stored = storage.size_of(artifact_key(row.id))
    if stored != row.size_bytes:
        raise Refused(422, ErrorCode.SIZE_MISMATCH, f"uploaded {stored} bytes, declared {row.size_bytes}")
    if size is not None and size != row.size_bytes:
        raise Refused(422, ErrorCode.SIZE_MISMATCH, f"confirmed size_bytes {size}, declared {row.size_bytes}")
    with local_copy(artifact_key(row.id)) as path:
        return check_file(path, row, digest)


def check_file(path: Path, row, digest: str | None) -> tuple[dict[str, Any], Entry]:
    """The checks of an artifact's whole file (uploaded, or rebuilt from its chunks): its sha256,
    a valid ``.kv`` (every tensor's digest), a manifest that agrees with what was declared; and the artifact's prefix-index entry."""
    computed = sha256_file(path)
    if computed != row.sha256 or (digest is not None and digest.lower() != computed):
        raise Refused(422, ErrorCode.SHA256_MISMATCH, "the uploaded bytes do not match the declared sha256")
    try:
        header = artifact.check_file(path)  # structure, every tensor's sha256, the token ids
        entry = entry_of(header, artifact.read_token_ids(path, header))
    except KvcdnError as exc:
        reason = (str(exc).partition(": ")[2] or str(exc) or "unreadable").splitlines()[0][:300]
        raise Refused(422, ErrorCode.NOT_A_KV_ARTIFACT, f"the upload is not a valid .kv artifact: {reason}") from None
    except (RecursionError, MemoryError, ValueError, TypeError, KeyError, AttributeError):
        raise Refused(422, ErrorCode.NOT_A_KV_ARTIFACT, "the upload is not a valid .kv artifact") from None
    try:
        summary = manifest_summary(header)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise Refused(422, ErrorCode.NOT_A_KV_ARTIFACT, "the upload's manifest is malformed") from None
    for hint, declared in json.loads(row.declared).items():
        if hint in HINTS and declared != summary[hint]:
            raise Refused(
                422,
                ErrorCode.MANIFEST_MISMATCH,
                f"declared {hint} {declared!r}, the artifact's manifest says {summary[hint]!r}",
            )
    return summary, entry


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()
