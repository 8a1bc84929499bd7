"""The storage contract: where artifacts live, addressed by a URI and holding objects under keys.

Local disk is built in (:mod:`kvcdn_core.builtin.local_storage`); S3 and the hosted endpoint are
plugins. What every backend promises (``kvcdn_core.testing.assert_storage_contract`` checks it):

- **URIs.** :func:`kvcdn_core.plugin_host.registry.open_storage` takes the scheme of the URI (``s3`` in
  ``s3://bucket/prefix``; a bare path means ``file``), finds the class whose ``schemes`` names it and
  calls ``cls.from_uri(uri)`` with the whole URI, unchanged. Parsing the rest is the backend's job.
- **Keys** are relative, ``/``-separated strings without empty, ``.`` or ``..`` parts or
  backslashes (:func:`safe_key`); a backend refuses others with :class:`KvcdnError`.
- **Missing keys.** ``exists`` is False, ``size_of`` and ``read_bytes`` return None, ``delete`` does
  nothing; ``get_file``, ``open_read`` and ``rename`` of a missing key raise :class:`ObjectNotFound`.
- **Overwrite.** ``put_file``/``write_bytes`` replace an existing object whole: a reader sees the old
  bytes or the new ones, never a mix, and never a partial object under the key.
- **Listing.** ``list(prefix)`` returns every object whose key *starts with* ``prefix`` as a string
  (``a/b`` matches ``a/bc.kv``), sorted by key, each with its size in bytes.
- **Rename** moves an object to another key, replacing the target; the source is gone afterwards.
- **Presigned URLs** are optional: None means the medium has none (the hosted server then signs
  its own and streams the bytes through :meth:`StorageBackend.open_read`).
- **Capabilities** are declared, never discovered by failing. ``stores`` says what the medium keeps:
  ``"bytes"`` (any object, the default) or ``"kv"`` (only valid ``.kv`` artifacts, like the hosted
  endpoint, which checks every upload). ``unsupported`` names the optional operations (from
  :data:`OPTIONAL_OPERATIONS`) the medium cannot do faithfully. Both are refused with
  :class:`NotSupported` before anything changes; nothing else may raise it. ``capabilities``
  names the extra abilities (from :data:`CAPABILITIES`) a backend offers beyond the interface:

  - ``"multipart"``: clients upload a large object in parts straight to the medium
    (:meth:`StorageBackend.needs_multipart`, ``start_multipart``, ``complete_multipart``,
    ``list_multipart``, ``abort_multipart``); the hosted server hands out the parts' URLs.
  - ``"local_path"``: every object is a file on this machine (:meth:`StorageBackend.path_of`):
    reading it gives the object's bytes, and a file atomically renamed onto it becomes the object.
    The hosted server then reads and writes the files directly and signs its own URLs.
  - ``"prefix_lookup"``: the medium keeps its own prefix index of ``.kv`` artifacts and answers
    lookups itself (:meth:`StorageBackend.prefix_roots`, ``prefix_lookup``, ``fetch_hit``,
    ``hit_chunks``, ``read_chunk``): the hosted endpoint. ``search --store`` and ``continue
    --store`` ask it instead of reading a chunk store's index objects, and the vLLM connector
    reads a hit's chunks one by one.
  - ``"chunk_store"``: the medium keeps artifacts as chunks itself and offers the chunk-store
    operations (:meth:`StorageBackend.chunk_store`: ``put``, ``get``, ``listing``, ``chunk_table``,
    ``delete``, ``check``, ``gc``, ``rebuild_index``, with the reports of
    :class:`kvcdn_core.store.chunkstore.ChunkStore`): the hosted endpoint, whose server checks and
    collects its own chunks. ``kvcdn store`` asks it instead of building a chunk store on the
    medium's bytes (:func:`kvcdn_core.store.chunkstore.open_chunk_store`).

  Callers read only the declaration (:meth:`StorageBackend.offers`), never probe for methods; a
  backend that declares a capability implements its methods, and one that does not is never asked.
- **Threads.** One backend instance is used from many threads at once (the server does): every
  method is safe to call concurrently; writers of one key race and the last whole object wins.
"""

from __future__ import annotations

import builtins
import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, ClassVar

from kvcdn_core.errors import KvcdnError


@dataclasses.dataclass
class ObjectInfo:
    """One listed object: its key and size in bytes."""

    key: str
    size: int


class ObjectNotFound(KvcdnError):
    """The object a read or rename named does not exist."""


class NotSupported(KvcdnError):
    """An operation or an object the backend declared it does not take (``unsupported``, ``stores``)."""


#: What a backend's ``stores`` may say: any bytes, or only valid ``.kv`` artifacts.
STORES = ("bytes", "kv")
#: The operations a backend may list in ``unsupported``.
OPTIONAL_OPERATIONS = frozenset({"rename"})
#: The extra abilities a backend may declare in ``capabilities``.
CAPABILITIES = frozenset({"multipart", "local_path", "prefix_lookup", "chunk_store"})


class StorageBackend:
    """The interface every storage backend implements.

    The first five methods are required. The others have portable defaults built on them; a backend
    overrides them where its medium does better (a server-side rename, a streaming read).
    """

    #: URI schemes this backend serves (``file``, ``s3``...).
    schemes: ClassVar[tuple[str, ...]] = ()
    #: What the medium keeps: ``"bytes"`` (any object) or ``"kv"`` (only valid ``.kv`` artifacts;
    #: storing anything else raises :class:`NotSupported`).
    stores: ClassVar[str] = "bytes"
    #: Optional operations (from :data:`OPTIONAL_OPERATIONS`) this backend does not offer: calling
    #: one raises :class:`NotSupported`.
    unsupported: ClassVar[frozenset[str]] = frozenset()
    #: Extra abilities (from :data:`CAPABILITIES`) this backend offers: ``"multipart"`` (the
    #: ``*_multipart`` methods), ``"local_path"`` (:meth:`path_of`). Declared, never probed.
    capabilities: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def offers(cls, capability: str) -> bool:
        """Whether this backend declares ``capability`` (one of :data:`CAPABILITIES`)."""
        return capability in cls.capabilities

    @classmethod
    def from_uri(cls, uri: str) -> StorageBackend:
        """The backend for ``uri``, the whole URI as the user gave it."""
        raise NotImplementedError

    def put_file(self, key: str, source: Path) -> None:
        """Store the file at ``source`` under ``key``, replacing any previous object."""
        raise NotImplementedError

    def get_file(self, key: str, target: Path) -> None:
        """Write object ``key`` to ``target`` atomically; :class:`ObjectNotFound` if it is missing."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove object ``key``; nothing happens when it does not exist."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        raise NotImplementedError

    # -- optional operations with portable defaults ----------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether object ``key`` exists."""
        return self.size_of(key) is not None

    def size_of(self, key: str) -> int | None:
        """Size of object ``key`` in bytes, or None when it does not exist."""
        for info in self.list(key):
            if info.key == key:
                return info.size
        return None

    def read_bytes(self, key: str) -> bytes | None:
        """The whole (small) object ``key``, or None when it does not exist."""
        try:
            with self.open_read(key) as stream:
                return stream.read()
        except ObjectNotFound:
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        """Store a small object, replacing any previous one."""
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "object"
            source.write_bytes(data)
            self.put_file(key, source)

    def open_read(self, key: str) -> IO[bytes]:
        """A binary stream of object ``key`` (``read(n)``, ``close()``, usable in ``with``).

        :class:`ObjectNotFound` when it is missing. The default stages the object in a temporary
        file; a backend whose medium streams should return that stream instead.
        """
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / "object"
            self.get_file(key, staged)
            stream = open(staged, "rb")  # noqa: SIM115 - the caller closes it
            shutil.rmtree(tmp, ignore_errors=True)  # the open handle keeps the bytes readable
        return stream

    def rename(self, source_key: str, target_key: str) -> None:
        """Move an object to another key, replacing the target (copy + delete by default).

        :class:`NotSupported` when the backend lists ``rename`` in ``unsupported``.
        """
        self.require("rename")
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / "object"
            self.get_file(source_key, staged)
            self.put_file(target_key, staged)
        self.delete(source_key)

    def presigned_url(self, method: str, key: str, expires_in: int, size: int | None = None) -> str | None:
        """A URL that lets its holder ``PUT``/``GET`` one object without credentials until it expires.

        None when the medium has no such URLs (the hosted server then signs its own).
        """
        return None

    # -- declared capabilities: only a backend that lists one in ``capabilities`` is asked ------

    def path_of(self, key: str) -> Path:
        """``"local_path"``: the file that holds object ``key`` (it need not exist yet)."""
        raise NotSupported(f"{type(self).__name__} does not declare local_path")

    def prefix_roots(self) -> builtins.list[dict[str, Any]]:
        """``"prefix_lookup"``: the roots of the artifacts the caller can find, as
        :func:`kvcdn_core.store.index.roots` gives them (``root``, ``model``, ``compute_dtype``,
        ``quantization``)."""
        raise NotSupported(f"{type(self).__name__} does not declare prefix_lookup")

    def prefix_lookup(self, root: str, query_ids: Any, start_tokens: int, limit: int) -> builtins.list[Any]:
        """``"prefix_lookup"``: :func:`kvcdn_core.store.index.lookup`'s hits for the query under
        ``root``, from the medium's own index (the query leaves as chain keys, never token ids)."""
        raise NotSupported(f"{type(self).__name__} does not declare prefix_lookup")

    def fetch_hit(self, hit: Any, target: Path) -> None:
        """``"prefix_lookup"``: download the artifact a hit names to ``target``, checked."""
        raise NotSupported(f"{type(self).__name__} does not declare prefix_lookup")

    def hit_chunks(self, hit: Any) -> tuple[Any, dict[str, str], float] | None:
        """``"prefix_lookup"``: the chunk record (:class:`kvcdn_core.store.record.ArtifactRecord`) of
        the artifact a hit names, per object digest where :meth:`read_chunk` reads it, and until when
        (Unix seconds) those locations hold; None when that artifact is stored whole (not by chunks)."""
        raise NotSupported(f"{type(self).__name__} does not declare prefix_lookup")

    def read_chunk(
        self, location: str, into: memoryview | None = None, landed: Callable[[int], None] | None = None
    ) -> bytes | memoryview | None:
        """``"prefix_lookup"``: the bytes at a location :meth:`hit_chunks` gave (unchecked: the
        caller checks the digest), or None when the object is gone or the location expired. Given
        ``into`` (memory the caller chose, the size it expects), read the bytes into it where the
        medium can (:func:`kvcdn_core.store.pack.read_into`); returning other bytes is allowed.
        Given ``landed``, tell it as the bytes arrive how many of ``into``'s first bytes are in
        place (``read_into`` does); a medium that never calls it, or whose ``read_chunk`` has no
        ``landed`` parameter (it is then not passed), is waited for whole."""
        raise NotSupported(f"{type(self).__name__} does not declare prefix_lookup")

    def chunk_store(self) -> Any:
        """``"chunk_store"``: the medium's own chunk store, with the operations and reports of
        :class:`kvcdn_core.store.chunkstore.ChunkStore`."""
        raise NotSupported(f"{type(self).__name__} does not declare chunk_store")

    def needs_multipart(self, size: int) -> bool:
        """``"multipart"``: whether an object of ``size`` bytes must go up in parts."""
        raise NotSupported(f"{type(self).__name__} does not declare multipart")

    def start_multipart(self, key: str, size: int, expires_in: int) -> dict[str, Any]:
        """``"multipart"``: begin an upload of ``size`` bytes to ``key`` in parts.

        Returns ``{"upload_id", "part_size", "parts": [{"part_number", "url", "size"}]}``: each
        part's bytes are PUT to its URL (valid ``expires_in`` seconds), whose answer's ``ETag``
        header the client keeps for :meth:`complete_multipart`.
        """
        raise NotSupported(f"{type(self).__name__} does not declare multipart")

    def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[dict[str, Any]]) -> None:
        """``"multipart"``: assemble the object from ``[{"part_number", "etag"}]``."""
        raise NotSupported(f"{type(self).__name__} does not declare multipart")

    def list_multipart(self, prefix: str = "") -> builtins.list[tuple[str, str]]:
        """``"multipart"``: ``(key, upload_id)`` of the uploads in progress under ``prefix``."""
        raise NotSupported(f"{type(self).__name__} does not declare multipart")

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """``"multipart"``: drop an upload in progress and its parts; nothing happens when it is gone."""
        raise NotSupported(f"{type(self).__name__} does not declare multipart")

    def require(self, operation: str) -> None:
        """Raise :class:`NotSupported` when ``operation`` is one this backend declared it does not offer."""
        if operation in type(self).unsupported:
            raise NotSupported(f"{type(self).__name__} does not support {operation}")


def safe_key(key: str) -> str:
    """``key`` unchanged when it is a valid storage key; :class:`KvcdnError` for one that could escape."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key:
        raise KvcdnError(f"invalid storage key '{key}'")
    return key


def check_prefix(prefix: str) -> str:
    """``prefix`` unchanged when it is a valid listing prefix (a key's start, possibly empty)."""
    if prefix.startswith("/") or ".." in prefix.split("/") or "\\" in prefix:
        raise KvcdnError(f"invalid storage prefix '{prefix}'")
    return prefix
