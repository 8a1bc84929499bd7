"""Server-side inference from an uploaded artifact, without repeating the prefill.

Models and recently used artifact caches stay resident (LRU: a number of models, a byte budget of
artifacts); each request works on a deep copy of the resident cache, so requests never see each
other's tokens. A fixed number of slots bounds concurrency: a request that finds none free is
refused at once (429) rather than queued, and one that runs past the timeout is answered 504 while
its slot stays taken until the computation really ends (a thread cannot be killed safely), so the
server never runs more work than it has slots for.

The answer is computed exactly as ``kvcdn continue --kv-path --question --n`` computes it: the same
``runtime.load_session``, ``runtime.load_cache``, ``adapter.encode_continuation`` and
``runtime.greedy``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcdn_core import KvcdnError

from kvcdn_server.errors import ApiError

#: per-key load locks are striped over this many locks, so their number stays bounded
LOAD_LOCK_STRIPES = 64
HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass
class InferResult:
    tokens: list[int]
    text: str
    model: str
    reused_tokens: int
    question_tokens: int


class ModelPolicy:
    """Which model references this server may load: an allow-list, or ids already in the HF cache."""

    def __init__(self, allowed: list[str]):
        self.allowed = list(allowed)
        self._resolved = {}
        for ref in allowed:
            local = Path(ref).expanduser()
            if local.is_dir():
                self._resolved[str(local.resolve())] = str(local.resolve())
            self._resolved[ref] = str(local.resolve()) if local.is_dir() else ref

    def resolve(self, model_id: str | None) -> str:
        """The reference to load for an artifact's model id; 422 when it may not be loaded."""
        if not model_id:
            raise ApiError(422, "model_not_available", "the artifact names no model")
        if model_id in self._resolved:
            return self._resolved[model_id]
        cached = _hf_cache_dir(model_id) if HF_ID.match(model_id) else None
        if cached is not None:
            return cached
        raise ApiError(422, "model_not_available",
                       f"model '{model_id}' is not allowed on this server (--models) nor in its model cache")


def _hf_cache_dir(model_id: str) -> str | None:
    """The local snapshot of a hub model already in the cache; never downloads."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_id, local_files_only=True)
    except Exception:
        return None


class _Lru:
    """A small thread-safe LRU with a cost budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self.items: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key][0]
        return None

    def put(self, key, value, cost: int) -> None:
        with self.lock:
            self.items[key] = (value, cost)
            self.items.move_to_end(key)
            while len(self.items) > 1 and sum(c for _, c in self.items.values()) > self.budget:
                self.items.popitem(last=False)


class InferenceEngine:
    def __init__(self, policy: ModelPolicy, concurrency: int, timeout: float, max_models: int,
                 cache_bytes: int, device: str = "auto"):
        self.policy = policy
        self.timeout = timeout
        self.device = device
        self.slots = threading.BoundedSemaphore(concurrency)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kvcdn-infer")
        self.models = _Lru(max_models)
        self.artifacts = _Lru(cache_bytes)
        # Striped: a fixed number of locks however many keys pass through (two keys may share one).
        # Artifacts and models have separate stripes, always taken artifact first, then model: one
        # shared pool would let a thread holding an artifact stripe wait on itself (or on a thread
        # waiting for it) when the model key lands on the same stripe.
        self._artifact_locks = [threading.Lock() for _ in range(LOAD_LOCK_STRIPES)]
        self._model_locks = [threading.Lock() for _ in range(LOAD_LOCK_STRIPES)]

    @staticmethod
    def _stripe(locks: list, key) -> threading.Lock:
        return locks[hash(key) % len(locks)]

    def run(self, artifact_key: tuple, fetch_path, question: str, n: int) -> InferResult:
        """Answer one request; ``fetch_path()`` gives a local path of the artifact when not resident."""
        if not self.slots.acquire(blocking=False):
            raise ApiError(429, "busy", "all inference slots are busy; retry shortly", {"Retry-After": "1"})
        try:
            future = self.pool.submit(self._infer, artifact_key, fetch_path, question, n)
        except BaseException:
            self.slots.release()
            raise
        future.add_done_callback(lambda _f: self.slots.release())
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise ApiError(504, "timeout", f"inference took longer than {self.timeout:g} s") from None

    def _session(self, model_ref: str, dtype: str):
        from kvcdn_core import runtime

        key = (model_ref, dtype)
        with self._stripe(self._model_locks, key):
            session = self.models.get(key)
            if session is None:
                session = runtime.load_session(model_ref, None, self.device, dtype)
                self.models.put(key, session, 1)
        return session

    def _resident(self, artifact_key: tuple, fetch_path):
        """``(session, cache, context ids)`` of an artifact, loading model and cache when needed."""
        from kvcdn_core import artifact, runtime

        with self._stripe(self._artifact_locks, artifact_key):
            entry = self.artifacts.get(artifact_key)
            if entry is None:
                with fetch_path() as path:
                    header = artifact.read_header(path)
                    model_ref = self.policy.resolve((header.manifest.get("model") or {}).get("id"))
                    session = self._session(model_ref, header.manifest.get("compute_dtype", "auto"))
                    cache, ids = runtime.load_cache(session, header)
                    entry = (model_ref, header.manifest.get("compute_dtype"), cache, ids,
                             header.manifest["model"]["id"])
                    self.artifacts.put(artifact_key, entry, header.file_size)
        model_ref, dtype, cache, ids, model_id = entry
        return self._session(model_ref, dtype), cache, ids, model_id

    def _infer(self, artifact_key: tuple, fetch_path, question: str, n: int) -> InferResult:
        from kvcdn_core import runtime

        try:
            session, resident_cache, context_ids, model_id = self._resident(artifact_key, fetch_path)
            cache = copy.deepcopy(resident_cache)  # greedy appends to the cache it is given
            question_ids = session.adapter.encode_continuation(session.tokenizer, question)
            ids, _ = runtime.greedy(session, cache, question_ids, n)
        except ApiError:
            raise
        except KvcdnError as exc:
            raise ApiError(422, "artifact_incompatible", _strip_paths(str(exc))) from None
        return InferResult(ids, runtime.decode(session, ids), model_id, len(context_ids), len(question_ids))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _strip_paths(message: str) -> str:
    return re.sub(r"(/[^\s:'\"]+)+", "<path>", message)
