"""kvcdn storage backend for S3 and S3-compatible stores: ``s3://bucket/prefix``.

Configuration comes from the usual AWS settings (``AWS_*`` variables, shared config and credential
files, instance roles), overridden by ``KVCDN_S3_*`` when set:

``KVCDN_S3_ENDPOINT_URL``         an S3-compatible endpoint (MinIO, Ceph, moto...)
``KVCDN_S3_PUBLIC_ENDPOINT_URL``  the endpoint presigned URLs name, when clients reach the store by
                                  another address than the server does
``KVCDN_S3_REGION``               region
``KVCDN_S3_ACCESS_KEY_ID`` / ``KVCDN_S3_SECRET_ACCESS_KEY`` / ``KVCDN_S3_SESSION_TOKEN``
``KVCDN_S3_ADDRESSING_STYLE``     ``path``, ``virtual`` or ``auto`` (default: ``path`` with a custom
                                  endpoint, else ``auto``)
``KVCDN_S3_PART_SIZE``            bytes per multipart part (default 512 MiB, 5 MiB..5 GiB): objects
                                  larger than this go up in parts (S3 refuses one PUT over 5 GiB)

boto3 is imported when a backend is created, never when kvcdn starts.
"""

from __future__ import annotations

import builtins
import math
import os
from pathlib import Path
from typing import IO, Any, ClassVar, cast
from urllib.parse import urlparse

from kvcdn_core import (
    KvcdnError,
    ObjectInfo,
    ObjectNotFound,
    StorageBackend,
    atomic_open,
    check_prefix,
    hookimpl,
    safe_key,
)

__version__ = "0.1.0"

MIB = 1 << 20
MIN_PART_SIZE = 5 * MIB  # S3's smallest part (all but the last)
MAX_PART_SIZE = 5 * 1024 * MIB  # S3's largest part and largest single PUT
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 512 * MIB
#: Threads of one download and the writes it may queue (of 256 KiB each; boto3's default is 100).
DOWNLOAD_THREADS = 4
DOWNLOAD_QUEUE = 16


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def part_size_from_env() -> int:
    raw = _env("KVCDN_S3_PART_SIZE")
    if raw is None:
        return DEFAULT_PART_SIZE
    try:
        size = int(raw)
    except ValueError:
        raise KvcdnError(f"KVCDN_S3_PART_SIZE must be a number of bytes, not '{raw}'") from None
    if not MIN_PART_SIZE <= size <= MAX_PART_SIZE:
        raise KvcdnError(f"KVCDN_S3_PART_SIZE must be between {MIN_PART_SIZE} and {MAX_PART_SIZE} bytes")
    return size


def _error(exc: Exception, what: str) -> KvcdnError:
    """One line from a botocore error."""
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    text = str(exc).strip()
    detail = code or (text.splitlines()[0] if text else type(exc).__name__)
    return KvcdnError(f"S3 {what} failed: {detail}")


class S3Storage(StorageBackend):
    """Objects in one bucket under an optional key prefix."""

    schemes: ClassVar[tuple[str, ...]] = ("s3",)
    capabilities: ClassVar[frozenset[str]] = frozenset({"multipart"})

    def __init__(self, bucket: str, prefix: str = "", part_size: int | None = None):
        if not bucket:
            raise KvcdnError("an S3 URI needs a bucket: s3://bucket[/prefix]")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = part_size or part_size_from_env()
        self._client: Any = None
        self._presigner: Any = None

    @classmethod
    def from_uri(cls, uri: str) -> S3Storage:
        parsed = urlparse(uri)
        if parsed.scheme != "s3":
            raise KvcdnError(f"'{uri}' is not an s3:// URI")
        return cls(parsed.netloc, parsed.path)

    def __repr__(self) -> str:
        return f"S3Storage(s3://{self.bucket}/{self.prefix})"

    # -- clients ---------------------------------------------------------------------------

    def _make_client(self, endpoint: str | None) -> Any:
        import boto3
        from botocore.config import Config

        style = _env("KVCDN_S3_ADDRESSING_STYLE") or ("path" if endpoint else "auto")
        config = Config(
            signature_version="s3v4", s3={"addressing_style": style}, retries={"max_attempts": 3, "mode": "standard"}
        )
        kwargs: dict[str, Any] = {"config": config}
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        if _env("KVCDN_S3_REGION"):
            kwargs["region_name"] = _env("KVCDN_S3_REGION")
        if _env("KVCDN_S3_ACCESS_KEY_ID"):
            kwargs["aws_access_key_id"] = _env("KVCDN_S3_ACCESS_KEY_ID")
            kwargs["aws_secret_access_key"] = _env("KVCDN_S3_SECRET_ACCESS_KEY")
            kwargs["aws_session_token"] = _env("KVCDN_S3_SESSION_TOKEN")
        return boto3.session.Session().client("s3", **kwargs)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._make_client(_env("KVCDN_S3_ENDPOINT_URL"))
        return self._client

    @property
    def presigner(self) -> Any:
        """The client that signs URLs for others: the public endpoint when one is configured."""
        if self._presigner is None:
            public = _env("KVCDN_S3_PUBLIC_ENDPOINT_URL")
            self._presigner = self._make_client(public) if public else self.client
        return self._presigner

    def _key(self, key: str) -> str:
        safe_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- the StorageBackend interface -----------------------------------------------------

    def put_file(self, key: str, source: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=self.part_size, multipart_chunksize=self.part_size)
        try:
            self.client.upload_file(str(source), self.bucket, self._key(key), Config=config)
        except Exception as exc:
            raise _error(exc, f"upload of '{key}'") from None

    def get_file(self, key: str, target: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        # What a download holds in memory is about its queue of pending writes (DOWNLOAD_QUEUE
        # pieces of 256 KiB) and one piece per thread: a few MiB, whatever the object's size (the
        # hosted server downloads every upload it checks, several at once).
        config = TransferConfig(max_concurrency=DOWNLOAD_THREADS, max_io_queue=DOWNLOAD_QUEUE)
        try:
            with atomic_open(target) as out:
                self.client.download_fileobj(self.bucket, self._key(key), out, Config=config)
        except Exception as exc:
            if _is_missing(exc):
                raise ObjectNotFound(f"no object '{key}' in {self!r}") from None
            raise _error(exc, f"download of '{key}'") from None

    def exists(self, key: str) -> bool:
        return self.size_of(key) is not None

    def size_of(self, key: str) -> int | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if _is_missing(exc):
                return None
            raise _error(exc, f"head of '{key}'") from None
        return int(head["ContentLength"])

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if not _is_missing(exc):
                raise _error(exc, f"delete of '{key}'") from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        found = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for item in page.get("Contents", []):
                    found.append(ObjectInfo(item["Key"][strip:], int(item["Size"])))
        except Exception as exc:
            raise _error(exc, f"listing of '{prefix}'") from None
        return found

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return cast(bytes, self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read())
        except Exception as exc:
            if _is_missing(exc):
                return None
            raise _error(exc, f"read of '{key}'") from None

    def write_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:
            raise _error(exc, f"write of '{key}'") from None

    def open_read(self, key: str) -> IO[bytes]:
        """A streaming binary reader of object ``key`` (``.read(n)``, ``.close()``)."""
        try:
            return cast(IO[bytes], self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"])
        except Exception as exc:
            if _is_missing(exc):
                raise ObjectNotFound(f"no object '{key}' in {self!r}") from None
            raise _error(exc, f"read of '{key}'") from None

    def rename(self, source_key: str, target_key: str) -> None:
        """Server-side copy (managed: multipart copy above 5 GiB), then delete the source.

        The copy is conditioned on the ETag the source had when the move began, so an object
        replaced meanwhile (a PUT with a still-valid URL) fails the move instead of being mixed in
        or moved unseen; a missing source is a :class:`KvcdnError`.
        """
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=self.part_size, multipart_chunksize=self.part_size)
        try:
            etag = self.client.head_object(Bucket=self.bucket, Key=self._key(source_key))["ETag"]
        except Exception as exc:
            if _is_missing(exc):
                raise ObjectNotFound(f"no object '{source_key}' in {self!r}") from None
            raise _error(exc, f"head of '{source_key}'") from None
        try:
            self.client.copy(
                {"Bucket": self.bucket, "Key": self._key(source_key)},
                self.bucket,
                self._key(target_key),
                ExtraArgs={"CopySourceIfMatch": etag},
                Config=config,
            )
        except Exception as exc:
            raise _error(exc, f"copy of '{source_key}'") from None
        self.delete(source_key)

    # -- presigned URLs and multipart uploads ---------------------------------------------

    def presigned_url(self, method: str, key: str, expires_in: int, size: int | None = None) -> str | None:
        operation = {"PUT": "put_object", "GET": "get_object"}.get(method.upper())
        if operation is None:
            raise ValueError(f"cannot presign {method}")
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key)}
        # Nothing but the length is signed (with Host): every client sends those two, and a signed
        # header a client leaves out (the original kvcdn client sends no Content-Type) makes S3
        # refuse the signature. An unsigned Content-Type a client does send is simply stored.
        if operation == "put_object":
            if size is not None:
                # Signed into the URL: S3 refuses a PUT of any other length.
                params["ContentLength"] = int(size)
        return cast(str, self.presigner.generate_presigned_url(operation, Params=params, ExpiresIn=int(expires_in)))

    def needs_multipart(self, size: int) -> bool:
        """Objects over one part go up in parts (S3 refuses one PUT over 5 GiB)."""
        return size > self.part_size

    def start_multipart(self, key: str, size: int, expires_in: int) -> dict[str, Any]:
        """Create a multipart upload and presign one PUT URL per part.

        Returns ``{"upload_id", "part_size", "parts": [{"part_number", "url", "size"}]}``.
        """
        count = math.ceil(size / self.part_size)
        if count > MAX_PARTS:
            raise KvcdnError(f"{size} bytes need {count} parts of {self.part_size}; S3 allows {MAX_PARTS}")
        try:
            upload_id = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), ContentType="application/octet-stream"
            )["UploadId"]
        except Exception as exc:
            raise _error(exc, f"multipart start of '{key}'") from None
        parts = []
        for number in range(1, count + 1):
            part_bytes = min(self.part_size, size - (number - 1) * self.part_size)
            url = self.presigner.generate_presigned_url(  # each part's length is signed into its URL
                "upload_part",
                ExpiresIn=int(expires_in),
                Params={
                    "Bucket": self.bucket,
                    "Key": self._key(key),
                    "UploadId": upload_id,
                    "PartNumber": number,
                    "ContentLength": part_bytes,
                },
            )
            parts.append({"part_number": number, "url": url, "size": part_bytes})
        return {"upload_id": upload_id, "part_size": self.part_size, "parts": parts}

    def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[dict[str, Any]]) -> None:
        """Finish a multipart upload from ``[{"part_number", "etag"}]``."""
        listing = [{"PartNumber": int(p["part_number"]), "ETag": str(p["etag"])} for p in parts]
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, MultipartUpload={"Parts": listing}
            )
        except Exception as exc:
            raise _error(exc, f"multipart completion of '{key}'") from None

    def list_multipart(self, prefix: str = "") -> builtins.list[tuple[str, str]]:
        """``(key, upload_id)`` of the multipart uploads in progress under ``prefix`` (for the
        hosted server's garbage collector: parts of an abandoned upload cost storage)."""
        if ".." in prefix.split("/") or prefix.startswith("/"):
            raise KvcdnError(f"invalid storage prefix '{prefix}'")
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        found = []
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full):
                for item in page.get("Uploads", []):
                    found.append((item["Key"][strip:], item["UploadId"]))
        except Exception as exc:
            raise _error(exc, f"multipart listing of '{prefix}'") from None
        return found

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
        except Exception as exc:
            if not _is_missing(exc):
                raise _error(exc, f"multipart abort of '{key}'") from None


def _is_missing(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchUpload") or status == 404


@hookimpl
def kvcdn_register_storage_backends() -> list[type[S3Storage]]:
    return [S3Storage]
