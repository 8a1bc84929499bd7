"""Server-side inference from an uploaded artifact, without repeating the prefill.

Shared by tenants that must not be able to starve each other or the server:

* **Slots.** A fixed number of requests run at once, and one tenant holds at most its fair share of
  them (``ceil(slots / 2)`` unless configured). A request that finds no slot is refused at once
  (429), never queued. A request holds its slot until it is answered, whatever the answer: a 504
  frees it at once, even while a model or artifact load it started finishes for the caches.
* **Turns.** Requests holding slots take turns on the model, one forward pass at a time, the next
  turn to the tenant that computed least lately (:mod:`kvcdn_server.turns`): a long request yields
  between decode steps, and a flooding tenant does not slow down one that computes little.
* **Limits before any work.** ``n``, the question's size in bytes (a bound its tokens cannot fit
  under) are refused (422 / 413) before a slot is taken, an artifact read or a model loaded; the
  artifact's context tokens (from its header) before its model loads, and the question's tokens
  once the tokenizer has counted them.
* **Cancellation.** A request that runs past the timeout (504) or whose client disconnects is
  cancelled: the decode loop checks between steps and stops, so the computation ends within one
  decode step, not when it would have ended.
* **Bounded memory.** Models and artifact caches stay resident in two LRUs budgeted in bytes (the
  parameters of a model, the tensors of a loaded cache); a cache larger than the whole budget is
  refused, so each request's private copy is bounded too.
* **The server decides.** Only models named by ``--models`` load, in the server's compute dtype;
  an artifact computed in another dtype, or naming any other model (even one in the local hub
  cache), is refused with 422.

The answer is computed exactly as ``kvcdn continue --kv-path --question --n`` computes it: the same
``runtime.load_session``, ``runtime.load_cache``, ``adapter.encode_continuation`` and
``runtime.greedy``. A request that composes several artifacts (:class:`Composing`) runs the same
:func:`kvcdn_core.compose.compose` as ``kvcdn continue --kv-path A --kv-path B --recompute R``, on
the resident caches; every artifact is checked as one alone is, and the sum of their tokens and of
their caches' bytes counts against the same limits. Its forward passes take turns and stop when
cancelled like the decode steps.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcdn_core import KvcdnError
from kvcdn_server.errors import ApiError
from kvcdn_server.lru import Lru
from kvcdn_server.turns import TurnCancelled, Turns
from kvcdn_wire import ErrorCode

log = logging.getLogger("kvcdn.server")
#: per-key load locks are striped over this many locks, so their number stays bounded
LOAD_LOCK_STRIPES = 64
#: how often a waiting request checks whether its client is still there (seconds)
DISCONNECT_POLL = 0.2
#: the question's UTF-8 bytes allowed per token of ``max_question_tokens`` unless configured: real
#: tokenizers average 2 to 6 bytes a token, so a question over this cannot fit in the token limit
QUESTION_BYTES_PER_TOKEN = 16


@dataclasses.dataclass
class InferResult:
    tokens: list[int]
    text: str
    model: str
    reused_tokens: int
    question_tokens: int
    composition: dict | None = None


@dataclasses.dataclass(frozen=True)
class Composing:
    """The artifacts composed after the request's first, in order, and how.

    ``more`` holds ``(artifact key, fetch_path, artifact id)`` of each; ``recompute`` and ``rule``
    are the local ``--recompute`` and ``--select``.
    """

    more: list[tuple[tuple, Callable, str]]
    recompute: float
    rule: str


@dataclasses.dataclass(frozen=True)
class InferLimits:
    """What one server lets inference use; built from :class:`~kvcdn_server.config.ServerConfig`."""

    slots: int = 2
    per_tenant: int = 0  # 0: ceil(slots / 2)
    timeout: float = 120.0
    max_new_tokens: int = 256
    max_question_tokens: int = 1024
    max_question_bytes: int = 0  # 0: QUESTION_BYTES_PER_TOKEN * max_question_tokens
    max_context_tokens: int = 32768
    model_bytes: int = 16 << 30
    max_models: int = 2
    cache_bytes: int = 4 << 30
    device: str = "auto"
    dtype: str = "auto"

    @property
    def tenant_slots(self) -> int:
        return min(self.slots, self.per_tenant or math.ceil(self.slots / 2))

    @property
    def question_bytes(self) -> int:
        return self.max_question_bytes or QUESTION_BYTES_PER_TOKEN * self.max_question_tokens

    @classmethod
    def from_config(cls, config) -> InferLimits:
        return cls(
            slots=config.infer_concurrency,
            per_tenant=config.infer_per_tenant,
            timeout=config.infer_timeout,
            max_new_tokens=config.infer_max_new_tokens,
            max_question_tokens=config.infer_max_question_tokens,
            max_question_bytes=config.infer_max_question_bytes,
            max_context_tokens=config.infer_max_context_tokens,
            model_bytes=config.infer_model_bytes,
            max_models=config.infer_max_models,
            cache_bytes=config.infer_cache_bytes,
            device=config.infer_device,
            dtype=config.infer_dtype,
        )


class ModelPolicy:
    """The models this server may load: exactly the ``--models`` allow-list, nothing else."""

    def __init__(self, allowed: list[str]):
        self.allowed = list(allowed)
        self._resolved = {}
        for ref in allowed:
            local = Path(ref).expanduser()
            if local.is_dir():
                self._resolved[str(local.resolve())] = str(local.resolve())
            self._resolved[ref] = str(local.resolve()) if local.is_dir() else ref

    def resolve(self, model_id: Any) -> str:
        """The reference to load for an artifact's model id; 422 when it may not be loaded."""
        if not model_id:
            raise ApiError(422, ErrorCode.MODEL_NOT_AVAILABLE, "the artifact names no model")
        if model_id in self._resolved:
            return self._resolved[model_id]
        raise ApiError(
            422, ErrorCode.MODEL_NOT_AVAILABLE, f"model '{model_id}' is not allowed on this server (--models)"
        )


class Slots:
    """``total`` slots, at most ``per_tenant`` held by one tenant; a request without one is refused."""

    def __init__(self, total: int, per_tenant: int):
        self.total, self.per_tenant = total, per_tenant
        self._held: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def acquire(self, tenant: str) -> None:
        with self._lock:
            self._refuse_when_busy(tenant)
            self._held[tenant] += 1

    def check(self, tenant: str) -> None:
        """429 now when ``tenant`` would get no slot: a refusal that costs no database query."""
        with self._lock:
            self._refuse_when_busy(tenant)

    def _refuse_when_busy(self, tenant: str) -> None:
        if sum(self._held.values()) >= self.total:
            raise ApiError(429, ErrorCode.BUSY, "all inference slots are busy; retry shortly", {"Retry-After": "1"})
        if self._held[tenant] >= self.per_tenant:
            raise ApiError(
                429,
                ErrorCode.BUSY,
                f"your {self.per_tenant} inference slot(s) are busy; retry shortly",
                {"Retry-After": "1"},
            )

    def release(self, tenant: str) -> None:
        with self._lock:
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]

    def in_use(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._held[tenant] if tenant is not None else sum(self._held.values())


class Cancelled(Exception):
    """The request was cancelled (timeout or disconnect); raised between decode steps."""


class _StopBetweenSteps:
    """A session's adapter whose ``forward`` and ``last_logits`` each wait for a turn on the model,
    and refuse to run once the request is cancelled."""

    def __init__(self, adapter, cancel: threading.Event, turns: Turns, ticket: int):
        self._adapter, self._cancel, self._turns, self._ticket = adapter, cancel, turns, ticket

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def _step(self, method, args, kwargs):
        if self._cancel.is_set():
            raise Cancelled()
        try:
            with self._turns.step(self._ticket, self._cancel):
                if self._cancel.is_set():
                    raise Cancelled()
                result = method(*args, **kwargs)
                _finish_on_device(result[0])
                return result
        except TurnCancelled:
            raise Cancelled() from None

    def forward(self, *args, **kwargs):
        return self._step(self._adapter.forward, args, kwargs)

    @contextlib.contextmanager
    def turn(self):
        """A turn for a forward pass made outside the adapter (the composition's own passes)."""
        if self._cancel.is_set():
            raise Cancelled()
        try:
            with self._turns.step(self._ticket, self._cancel):
                if self._cancel.is_set():
                    raise Cancelled()
                yield
        except TurnCancelled:
            raise Cancelled() from None

    def last_logits(self, *args, **kwargs):
        return self._step(self._adapter.last_logits, args, kwargs)


def _finish_on_device(logits) -> None:
    """Wait for an accelerator to finish the pass, so that its turn (and its charge) covers the
    device's work and not just the launch of its kernels; greedy reads the logits next anyway."""
    if getattr(logits, "is_cuda", False):
        import torch

        torch.cuda.synchronize(logits.device)


def tensor_bytes(obj: Any, depth: int = 4) -> int:
    """Bytes of the distinct torch tensors reachable from ``obj`` (a model cache, a model)."""
    import torch

    seen: set[int] = set()

    def walk(value, left):
        if isinstance(value, torch.Tensor):
            ptr = value.untyped_storage().data_ptr()
            if ptr in seen:
                return 0
            seen.add(ptr)
            return value.untyped_storage().nbytes()
        if left == 0:
            return 0
        if isinstance(value, (list, tuple)):
            return sum(walk(v, left - 1) for v in value)
        if isinstance(value, dict):
            return sum(walk(v, left - 1) for v in value.values())
        if hasattr(value, "__dict__") and not isinstance(value, type):
            return sum(walk(v, left - 1) for v in vars(value).values())
        return 0

    return walk(obj, depth)


def _model_bytes(model) -> int:
    import itertools

    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


class InferenceEngine:
    def __init__(self, policy: ModelPolicy, limits: InferLimits):
        self.policy = policy
        self.limits = limits
        self.timeout = limits.timeout
        self.slots = Slots(limits.slots, limits.tenant_slots)
        self.turns = Turns()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=limits.slots, thread_name_prefix="kvcdn-infer")
        self.models = Lru(limits.model_bytes, limits.max_models)
        self.artifacts = Lru(limits.cache_bytes)
        # Striped: a fixed number of locks however many keys pass through (two keys may share one).
        # Artifacts and models have separate stripes, always taken artifact first, then model: one
        # shared pool would let a thread holding an artifact stripe wait on itself (or on a thread
        # waiting for it) when the model key lands on the same stripe.
        self._artifact_locks = [threading.Lock() for _ in range(LOAD_LOCK_STRIPES)]
        self._model_locks = [threading.Lock() for _ in range(LOAD_LOCK_STRIPES)]

    @classmethod
    def from_config(cls, config) -> InferenceEngine:
        return cls(ModelPolicy(config.models), InferLimits.from_config(config))

    @staticmethod
    def _stripe(locks: list, key) -> threading.Lock:
        return locks[hash(key) % len(locks)]

    def run(
        self,
        tenant: str,
        artifact_key: tuple,
        fetch_path,
        question: str,
        n: int,
        disconnected: Callable[[], bool] | None = None,
        composing: Composing | None = None,
    ) -> InferResult:
        """Answer one request of ``tenant``; ``fetch_path()`` gives a local path of the artifact
        (with ``composing``, of the first of the composed artifacts).

        ``disconnected()`` says whether the client went away; it is polled while the request runs.
        On a timeout or a disconnect the computation is cancelled before its next decode step.
        """
        self.check_request(question, n)
        return self.run_in_slot(
            tenant,
            lambda cancel: self._infer(tenant, artifact_key, fetch_path, question, n, cancel, composing),
            disconnected,
        )

    def run_in_slot(
        self, tenant: str, work: Callable[[threading.Event], Any], disconnected: Callable[[], bool] | None
    ) -> Any:
        """``work(cancel)`` on the pool while ``tenant`` holds a slot: 504 past the timeout, 499 when
        the client goes away; either way ``cancel`` is set, and ``work`` stops at its next step.
        ``work`` returns None only once cancelled. Shared with the remote engine (:mod:`kvcdn_server.remote`)."""
        self.slots.acquire(tenant)
        cancel = threading.Event()
        try:
            future = self.pool.submit(work, cancel)
            deadline = time.monotonic() + self.timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(504, ErrorCode.TIMEOUT, f"inference took longer than {self.timeout:g} s")
                try:
                    result = future.result(timeout=min(left, DISCONNECT_POLL))
                except concurrent.futures.TimeoutError:
                    if disconnected is not None and disconnected():
                        raise ApiError(499, ErrorCode.CLIENT_CLOSED_REQUEST, "the client disconnected") from None
                    continue
                # None is a cancelled run, and only this call cancels it, after it has answered.
                assert result is not None
                return result
        finally:
            cancel.set()  # a no-op once done; otherwise the decode loop stops at its next step
            # The slot goes with the answer: a load still running finishes for the caches (it cannot
            # be interrupted) but no longer counts against the tenant.
            self.slots.release(tenant)

    def check_request(self, question: str, n: int) -> None:
        """Refuse what the request alone shows is over a limit: before a slot, an artifact or a model."""
        if n > self.limits.max_new_tokens:
            raise ApiError(
                422,
                ErrorCode.TOO_MANY_TOKENS,
                f"n is {n}; this server decodes at most {self.limits.max_new_tokens} tokens",
            )
        size = len(question.encode("utf-8", "surrogatepass"))
        if size > self.limits.question_bytes:
            raise ApiError(
                413,
                ErrorCode.QUESTION_TOO_LONG,
                f"the question is {size} bytes; this server takes at most {self.limits.question_bytes} "
                f"(and {self.limits.max_question_tokens} tokens)",
            )

    def check_context(self, tokens: int, what: str = "the artifact holds") -> None:
        """422 when ``tokens`` of context (one artifact's, or a composition's sum) are over the limit."""
        if tokens > self.limits.max_context_tokens:
            raise ApiError(
                422,
                ErrorCode.CONTEXT_TOO_LONG,
                f"{what} {tokens} context tokens; this server infers from at most {self.limits.max_context_tokens}",
            )

    def check_cache_bytes(self, cost: int, what: str = "the artifact's cache takes") -> None:
        """413 when caches of ``cost`` bytes (one artifact's, or a composition's sum) are over the budget."""
        if cost > self.limits.cache_bytes:
            raise ApiError(
                413,
                ErrorCode.ARTIFACT_TOO_LARGE,
                f"{what} {cost} bytes in memory; this server holds at most {self.limits.cache_bytes}",
            )

    def _session(self, model_ref: str):
        from kvcdn_core import runtime

        with self._stripe(self._model_locks, model_ref):
            session = self.models.get(model_ref)
            if session is None:
                session = runtime.load_session(model_ref, None, self.limits.device, self.limits.dtype)
                self.models.put(model_ref, session, _model_bytes(session.model))
        return session

    def _resident(self, artifact_key: tuple, fetch_path):
        """``(session, cache, context ids, manifest)`` of an artifact, loading model and cache when needed."""
        from kvcdn_core import artifact, manifest_of, runtime

        with self._stripe(self._artifact_locks, artifact_key):
            entry = self.artifacts.get(artifact_key)
            if entry is None:
                with fetch_path() as path:
                    header = artifact.read_header(path)
                    self.check_context(header.token_count)
                    manifest = manifest_of(header)
                    model_id = manifest.model.id
                    model_ref = self.policy.resolve(model_id)
                    session = self._session(model_ref)
                    if manifest.compute_dtype != session.dtype:
                        raise ApiError(
                            422,
                            ErrorCode.DTYPE_MISMATCH,
                            f"the artifact was computed in {manifest.compute_dtype}; "
                            f"this server computes in {session.dtype}",
                        )
                    cache, ids = runtime.load_cache(session, header)
                    cost = tensor_bytes(cache)
                    self.check_cache_bytes(cost)
                    entry = (model_ref, cache, ids, manifest)
                    self.artifacts.put(artifact_key, entry, cost)
        model_ref, cache, ids, manifest = entry
        return self._session(model_ref), cache, ids, manifest

    def _composed_parts(self, first: tuple, composing: Composing) -> list[tuple[Any, list[int]]]:
        """The ``(cache, ids)`` of every composed artifact, after the checks on them all together:
        one model and dtype, the sum of their tokens and of their caches' bytes within the limits."""
        from kvcdn_core import compose

        session, cache, ids, manifest = first
        parts = [(cache, ids)]
        for key, fetch_path, artifact_id in composing.more:
            _, other_cache, other_ids, other = self._resident(key, fetch_path)
            differs = compose.model_differences(manifest, other)
            if differs:
                raise ApiError(
                    422,
                    ErrorCode.MODELS_DIFFER,
                    f"cannot compose artifact {artifact_id} after the first: made with a different model "
                    f"({', '.join(differs)} differ)",
                )
            parts.append((other_cache, other_ids))
        self.check_context(sum(len(part_ids) for _, part_ids in parts), "the composed artifacts hold")
        self.check_cache_bytes(
            sum(tensor_bytes(part_cache) for part_cache, _ in parts), "the composed artifacts' caches take"
        )
        compose.composable(session, manifest.layers)
        return parts

    def _infer(
        self,
        tenant: str,
        artifact_key: tuple,
        fetch_path,
        question: str,
        n: int,
        cancel: threading.Event,
        composing: Composing | None = None,
    ) -> InferResult | None:
        from kvcdn_core import compose, runtime

        if cancel.is_set():  # answered (504, 499) before a worker took it up: load nothing
            return None
        composition = None
        try:
            first = self._resident(artifact_key, fetch_path)
            session, resident_cache, context_ids, manifest = first
            parts = self._composed_parts(first, composing) if composing is not None else None
            question_ids = session.adapter.encode_continuation(session.tokenizer, question)
            if len(question_ids) > self.limits.max_question_tokens:
                raise ApiError(
                    413,
                    ErrorCode.QUESTION_TOO_LONG,
                    f"the question is {len(question_ids)} tokens; this server takes at most "
                    f"{self.limits.max_question_tokens}",
                )
            if cancel.is_set():
                return None
            with self.turns.request(tenant) as ticket:
                stoppable = dataclasses.replace(
                    session, adapter=_StopBetweenSteps(session.adapter, cancel, self.turns, ticket)
                )
                if composing is not None:  # a new cache, private to this request
                    composed = compose.compose(stoppable, [], composing.recompute, composing.rule, parts=parts)
                    cache, context_ids, composition = composed.cache, composed.ids, composed.as_dict()
                else:
                    cache = session.adapter.fork_cache(resident_cache)  # greedy extends the cache it is given
                ids, _ = runtime.greedy(stoppable, cache, question_ids, n)
        except Cancelled:
            return None
        except ApiError:
            raise
        except KvcdnError as exc:
            raise ApiError(422, ErrorCode.ARTIFACT_INCOMPATIBLE, _strip_paths(str(exc))) from None
        except (TypeError, KeyError, IndexError, AttributeError, ValueError, RuntimeError) as exc:
            # The header passed validation, yet a scheme's own fields (a quantizer's record, say)
            # tripped the loader: the artifact's fault, not the server's. Logged for the operator.
            log.warning("artifact %s could not be loaded", artifact_key[1], exc_info=exc)
            raise ApiError(
                422, ErrorCode.ARTIFACT_INCOMPATIBLE, f"the artifact could not be loaded ({type(exc).__name__})"
            ) from None
        return InferResult(
            ids, runtime.decode(session, ids), manifest.model.id, len(context_ids), len(question_ids), composition
        )

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _strip_paths(message: str) -> str:
    return re.sub(r"(/[^\s:'\"]+)+", "<path>", message)
