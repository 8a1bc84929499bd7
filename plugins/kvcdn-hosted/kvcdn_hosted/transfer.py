"""Moving artifact bytes: streamed, hashed, retried, and never left half-written.

Uploads stream the file to a presigned URL (re-opened on every retry). Downloads stream into a
temporary file next to the target while hashing, then check size, sha256 and that the result is a
readable ``.kv`` whose tensors match their hashes before an atomic rename; any failure removes the
temporary file. Downloaded artifacts follow the umask, like generated ones.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

from kvcdn_core import CheckFailed, KvcdnError, Progress, atomic_path
from kvcdn_hosted.client import ATTEMPTS, TRANSIENT_STATUSES, backoff_delay, server_message

CHUNK = 1 << 20


def sha256_file(path: Path, label: str | None = None, quiet: bool = True) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as fh, Progress(size, label or "sha256", unit="bytes", enabled=not quiet) as bar:
        while block := fh.read(CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _file_chunks(path: Path, start: int, length: int, bar: Progress) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        fh.seek(start)
        left = length
        while left > 0:
            block = fh.read(min(CHUNK, left))
            if not block:
                raise KvcdnError(f"{path} shrank while it was being uploaded")
            left -= len(block)
            bar.update(len(block))
            yield block


def put_bytes(
    http,
    url: str,
    path: Path,
    *,
    start: int = 0,
    length: int | None = None,
    headers: dict[str, str] | None = None,
    label: str = "upload",
    quiet: bool = False,
    attempts: int = ATTEMPTS,
):
    """PUT ``length`` bytes of ``path`` from ``start`` to ``url``; return the final response."""
    import httpx

    length = path.stat().st_size - start if length is None else length
    sent = {"Content-Length": str(length)}
    sent.update(headers or {})
    for attempt in range(attempts):
        with Progress(length, label, unit="bytes", enabled=not quiet) as bar:
            try:
                response = http.put(
                    url,
                    content=_file_chunks(path, start, length, bar),
                    headers=sent,
                    timeout=httpx.Timeout(300.0, connect=10.0),
                )
            except httpx.TransportError as exc:
                if attempt + 1 < attempts:
                    time.sleep(backoff_delay(attempt))
                    continue
                raise KvcdnError(f"upload failed: {type(exc).__name__}: {exc}") from None
        if response.status_code in TRANSIENT_STATUSES or response.status_code >= 500:
            if attempt + 1 < attempts:
                time.sleep(backoff_delay(attempt, response.headers.get("Retry-After")))
                continue
        if response.status_code >= 400:
            raise KvcdnError(f"upload failed: the storage answered {response.status_code}: {server_message(response)}")
        return response
    raise AssertionError("unreachable")


def download_to(
    http,
    url: str,
    target: Path,
    *,
    sha256: str | None,
    size: int | None,
    headers: dict[str, str] | None = None,
    label: str = "download",
    quiet: bool = False,
    attempts: int = ATTEMPTS,
) -> Path:
    """Stream ``url`` into ``target`` atomically after checking size, sha256 and the ``.kv`` file.

    The file gets the permissions of any file kvcdn writes (``0666`` less the umask, as generated
    artifacts): an artifact is not a secret. Only credentials are kept 0600.
    """
    target = Path(target)
    last_error = "no attempt made"
    for attempt in range(attempts):
        try:
            with atomic_path(target, suffix=".part") as tmp:
                digest, received = _stream_into(http, url, tmp, headers, size, label, quiet)
                if size is not None and received != size:
                    raise CheckFailed(f"download failed: received {received} bytes, expected {size}")
                if sha256 and digest != str(sha256).lower():
                    raise CheckFailed(f"download failed: sha256 {digest} does not match the expected {sha256}")
                check_artifact(tmp)
            return target
        except _Transient as exc:
            last_error = str(exc)
            if attempt + 1 < attempts:
                time.sleep(backoff_delay(attempt, exc.retry_after))
                continue
            raise KvcdnError(f"download failed after {attempts} attempts: {last_error}") from None
    raise KvcdnError(f"download failed: {last_error}")


class _Transient(Exception):
    def __init__(self, message: str, retry_after: str | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _stream_into(http, url, path: Path, headers, size, label, quiet) -> tuple[str, int]:
    import httpx

    digest = hashlib.sha256()
    received = 0
    with open(path, "wb") as out:
        try:
            with http.stream("GET", url, headers=headers or {}, timeout=httpx.Timeout(300.0, connect=10.0)) as response:
                if response.status_code in TRANSIENT_STATUSES or response.status_code >= 500:
                    response.read()
                    raise _Transient(
                        f"the storage answered {response.status_code}: {server_message(response)}",
                        response.headers.get("Retry-After"),
                    )
                if response.status_code >= 400:
                    response.read()
                    raise KvcdnError(
                        f"download failed: the storage answered {response.status_code}: {server_message(response)}"
                    )
                total = size or int(response.headers.get("Content-Length") or 0)
                with Progress(total, label, unit="bytes", enabled=not quiet) as bar:
                    for block in response.iter_bytes():  # as it arrives, for the progress bar
                        out.write(block)
                        digest.update(block)
                        received += len(block)
                        bar.update(len(block))
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc} after {received} bytes") from None
    return digest.hexdigest(), received


def check_artifact(path: Path) -> None:
    """A downloaded file must be a readable ``.kv`` whose tensors match their manifest hashes.

    A failure is :class:`CheckFailed` (exit 1): the bytes arrived, and they are not what was promised.
    """
    from kvcdn_core import ArtifactError, artifact

    try:
        artifact.check_file(path)
    except ArtifactError as exc:
        reason = str(exc).removeprefix(f"{path}: ")
        raise CheckFailed(f"download failed: the object is not a valid .kv artifact ({reason})") from None
