"""``KvcdnConnector``: vLLM's v1 KV connector API on top of kvcdn artifacts.

Scheduler side (no torch work): for each new request, :class:`~kvcdn_vllm.catalog.Catalog` finds the
artifact of the engine's model with the longest token prefix of the prompt and the connector reports
that many block-aligned tokens as loadable; when blocks are allocated it records a load plan. With
``save: true`` it also marks prompts that no artifact holds yet, and asks the workers to save each
one in the step that computes its last prompt token.

Worker side: :meth:`start_load_kv` reads the artifact (dequantizing a quantized one), checks its
token ids against the prompt, and scatters the planned tokens' keys and values into the request's
blocks through each layer's :class:`~kvcdn_vllm.layout.BlockLayout`. :meth:`save_kv_layer` gathers a
saved prompt's keys and values layer by layer, and :meth:`wait_for_save` writes the artifact
(:mod:`kvcdn_vllm.writer`); on a chunk store without tensor parallelism the gather runs after the
forward instead, on a thread of its own (see :meth:`KvcdnConnector.wait_for_save`). A failed load reports its blocks to vLLM (which recomputes them under
``kv_load_failure_policy: recompute``) after one warning line; a failed save is one warning line.

On a chunk store (``store`` instead of ``source``): the scheduler looks each prompt up in the
store's prefix index (:mod:`kvcdn_vllm.lookup`) and plans the chunks that hold the match; the worker
takes them from its local tier (:mod:`kvcdn_vllm.tier`: memory, disk, then the store, each chunk's
digest checked once where it enters), copies them into the blocks layer by layer under the forward
(:mod:`kvcdn_vllm.layers`), and reports per-request figures back to the scheduler
(:class:`KvcdnWorkerMeta`), which returns them in ``kv_transfer_params``. Saves go to a bounded
queue whose process puts only the chunks the store lacks (:mod:`kvcdn_vllm.saver`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcdn_core import KvcdnError, artifact, layer_tensor_name
from kvcdn_core.store.keys import CHUNK_TOKENS
from kvcdn_vllm import layout as paged
from kvcdn_vllm import lookup as chunks
from kvcdn_vllm.catalog import Catalog, Hit, ModelShape, check_fits
from kvcdn_vllm.layers import LayerCopies, LayerLoader, PartCopy
from kvcdn_vllm.parallel import HeadGather, head_selection
from kvcdn_vllm.settings import Settings
from kvcdn_vllm.source import Source
from kvcdn_vllm.tier import MEMORY, PROCESS_STAND_ASIDE, REMOTE, Arrival, ChunkBytes
from kvcdn_vllm.writer import SavedModel, artifact_name, write_prompt_artifact

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvcdn_vllm.saver import Handover

logger = init_logger("vllm.kvcdn_vllm")  # under vLLM's logger, so its handler and format apply


def _warn(message: str) -> None:
    logger.warning("kvcdn: %s", message)


def _info(message: str) -> None:
    logger.info("kvcdn: %s", message)


@dataclasses.dataclass
class LoadJob:
    """Copy tokens ``[start, end)`` of ``path`` into the request's blocks."""

    req_id: str
    path: str
    start: int
    end: int
    prompt_ids: list[int]
    block_ids: list[int] = dataclasses.field(default_factory=list)
    chunks: chunks.ChunkPlan | None = None  # from a chunk store: the parts holding [0, end)
    keep: bool = False  # the request is to be saved: keep the loaded rows for its save


@dataclasses.dataclass
class SaveJob:
    """Gather the request's prompt from its blocks and write it as an artifact.

    ``loaded``: tokens ``[start, end)`` the connector loaded into the blocks from the store's
    chunks (their rows are those bytes, bit for bit): the worker takes them from the rows it
    kept at the load instead of copying them out of the blocks again.
    """

    req_id: str
    prompt_ids: list[int]
    block_ids: list[int]
    loaded: tuple[int, int] | None = None


@dataclasses.dataclass
class KvcdnMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = dataclasses.field(default_factory=list)
    saves: list[SaveJob] = dataclasses.field(default_factory=list)
    #: requests preempted in this step: their blocks go back to vLLM, so no gather may still read them
    preempted: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class KvcdnWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, once per step: each loaded request's figures (chunks from memory, disk,
    remote; bytes fetched from the store). Under tensor parallelism every rank loads the same
    chunks for its own heads; the first rank's figures are kept."""

    figures: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvcdnWorkerMeta):
            for req_id, figures in other.figures.items():
                self.figures.setdefault(req_id, figures)
        return self


@dataclasses.dataclass
class _Pending:
    """A request's prompt on the scheduler side, until its save job is issued."""

    prompt_ids: list[int]
    loaded: tuple[int, int] | None = None  # tokens the connector loads for it from a chunk store


@dataclasses.dataclass
class _Kept:
    """Worker side: the rows a load copied into a request's blocks from the store's chunks, each
    layer's ``(keys, values)`` for tokens ``[start, end)``, kept for the request's save."""

    start: int
    end: int
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class _SaveRows:
    """Worker side, one save job in its step: the token ranges copied out of the blocks (token
    slots computed once for every layer) and the kept rows that fill the gap between them."""

    ranges: list[tuple[int, int]]
    slots: list[Callable[[str, torch.Tensor], paged.TokenSlots]]
    kept: _Kept | None
    #: the save queue's shared memory the layers are gathered straight into (none under tensor
    #: parallelism, whose first worker hands over what every worker gathered)
    handover: Handover | None = None

    def in_token_order(self) -> list[tuple[int, int | None]]:
        """``(start, i)`` of each piece in token order: ``i`` the range's index, None the kept rows."""
        pieces: list[tuple[int, int | None]] = [(a, i) for i, (a, _b) in enumerate(self.ranges)]
        if self.kept is not None:
            pieces.append((self.kept.start, None))
        return sorted(pieces, key=lambda piece: piece[0])


def model_facts(vllm_config: VllmConfig) -> tuple[Path, dict, ModelShape]:
    """The engine's model directory, kvcdn fingerprint and cache shape (config and files only)."""
    from kvcdn_core import fingerprint, resolve_model_dir

    mc = vllm_config.model_config
    model_dir = resolve_model_dir(mc.model, mc.revision, weights=False)
    shape = ModelShape(
        int(mc.hf_text_config.num_hidden_layers), int(mc.get_total_num_kv_heads()), int(mc.get_head_size())
    )
    return model_dir, fingerprint(model_dir), shape


def _chunk_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """A whole chunk of the engine's model as a store holds it: every layer's keys and values, all
    heads, ``CHUNK_TOKENS`` tokens, in the compute dtype. It only sizes the tier's ready buffers
    (a part of another size is read into new memory), so a model whose chunk differs loses nothing."""
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_size * CHUNK_TOKENS * dtype.itemsize


class KvcdnConnector(KVConnectorBase_V1):
    """Loads prompt prefixes from kvcdn ``.kv`` artifacts into vLLM's paged cache, and saves them."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = Settings.parse(extra, self._block_size)
        self._model_dir, self._fingerprint, self._shape = model_facts(vllm_config)
        self._store: chunks.Lookup | None = None
        if self.settings.store:
            dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
            root = chunks.engine_root(self._fingerprint, dtype)
            self._store = chunks.open_lookup(self.settings.store, root, _warn)
            if role == KVConnectorRole.SCHEDULER and isinstance(self._store, chunks.StoreLookup):
                # the index read while the engine starts (a slow store does not hold the start up),
                # so that the first request's lookup does not read all of it
                threading.Thread(target=self._store.warm, name="kvcdn-index-warm", daemon=True).start()
        else:
            assert self.settings.source is not None
            self._source = Source(self.settings.source, create=self.settings.save, warn=_warn)
        parallel = vllm_config.parallel_config
        # under tensor parallelism the first TP rank saves what every rank gathered (kvcdn_vllm.parallel)
        self._can_save = self.settings.save and parallel.pipeline_parallel_size == 1
        if self.settings.save and not self._can_save:
            _warn(
                "save is on but pipeline parallelism splits the layers across workers; "
                "prompts are not saved (loading works)"
            )
        # both sides: a saved prompt is gathered after the forward, its blocks held until then
        # (a chunk store's save process, one worker; tensor parallelism gathers in step, on every rank)
        self._gather_after_forward = self._can_save and self._store is not None and parallel.tensor_parallel_size == 1
        self._heads_gather: HeadGather | None = None
        if self._can_save and role == KVConnectorRole.WORKER and parallel.tensor_parallel_size > 1:
            self._heads_gather = HeadGather.of_engine(self._shape.num_kv_heads)
        # scheduler side
        if self._store is None:
            self._catalog = Catalog(self._source.directory, self._fingerprint, self._shape, _warn)
        self._hits: dict[str, Any] = {}
        self._stored_prefix: dict[str, int] = {}  # request → tokens the store holds (chunk store)
        self._figures: dict[str, dict[str, int]] = {}
        self._unfilled: dict[str, dict[str, Any]] = {}  # finished in their load step: figures to come
        self._loads: dict[str, LoadJob] = {}
        self._loaded: dict[str, tuple[int, str]] = {}
        self._pending_saves: dict[str, _Pending] = {}
        self._blocks_held: set[str] = set()  # saves gathered after the forward: freed when they report
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, paged.BlockLayout] = {}
        self._kernel_ratio = 1
        self._heads: slice | torch.Tensor = slice(None)
        self._artifact_cache: tuple[tuple, dict[str, torch.Tensor]] | None = None
        self._failed_blocks: set[int] = set()
        self._gathered: dict[str, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._save_rows: dict[str, _SaveRows | None] = {}
        self._kept: dict[str, _Kept] = {}
        #: request → its gather after the forward (None: given up in step); reported once it finished
        self._gathers: dict[str, Future | None] = {}
        self._gatherer: ThreadPoolExecutor | None = None
        self._tier = None
        self._saver = None
        #: this step's parts copied layer by layer under the forward (kvcdn_vllm.layers)
        self._layer_copies: list[PartCopy] = []
        self._step_copies: LayerCopies | None = None  # this step's, over _layer_copies
        self._copy_failed: dict[str, tuple[LoadJob, Exception]] = {}  # written by the loader thread
        #: chunks fetched this step whose digest is checked under the forward: size, requests using them
        self._to_check: dict[str, tuple[int, list[LoadJob]]] = {}
        #: this step's chunk loads, their figures counted once their chunks settled
        self._arriving: list[tuple[LoadJob, chunks.ChunkPlan, list[Arrival]]] = []
        self._loader: LayerLoader | None = None
        self._step_figures: dict[str, dict[str, int]] = {}
        self._totals: dict[str, int] = {}
        if self._store is not None and role == KVConnectorRole.WORKER:
            from pathlib import Path as _Path

            from kvcdn_vllm.tier import ChunkTier, TouchedBuffers

            s = self.settings
            directory = _Path(s.tier_directory).expanduser() if s.tier_directory else None
            chunk_bytes = _chunk_bytes(self._shape, vllm_config.model_config.dtype)
            stand_aside = PROCESS_STAND_ASIDE  # held while a step's chunks load, and by the lookups
            self._tier = ChunkTier(
                self._store.fetch,
                s.tier_memory_bytes,
                s.tier_disk_bytes,
                directory,
                _warn,
                write_queue_bytes=s.tier_write_queue_bytes,
                buffers=TouchedBuffers.for_budget(chunk_bytes, s.tier_memory_bytes, stand_aside),
                stand_aside=stand_aside,
            )
            self._tier.start_warming()  # the chunks the last run used, into memory before they are asked
            self._loader = LayerLoader()
            if self._can_save and (self._heads_gather is None or self._heads_gather.first):
                from kvcdn_vllm.saver import SaveQueue, SaveTarget

                # a process of its own opens the store and puts the saves (kvcdn_vllm.saver), so
                # that saving never holds the forward's Python lock nor waits on the tier's fetches
                assert s.store is not None
                model = SavedModel.of_engine(vllm_config, self._model_dir, self._fingerprint)
                self._saver = SaveQueue(
                    SaveTarget(s.store, model, self._block_size), s.save_queue, _warn, self._saved, _info
                )
                if self._gather_after_forward:
                    self._gatherer = ThreadPoolExecutor(1, thread_name_prefix="kvcdn-gather")

    # ==== scheduler side ==========================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self._hits.pop(request.request_id, None)
        if not _plain_text_request(request):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        if not self._can_save and num_computed_tokens >= self._loadable(prompt, len(prompt)):
            # vLLM's own prefix cache holds every block a load could fill (all but the last token
            # is computed, in whole blocks): no store can add to that, so no lookup is made. An
            # engine that saves still asks: the answer says whether the store holds the prompt.
            return 0, False
        hit: _StoreHit | Hit | None
        grant = _grant_of(request)
        if grant is not None:
            hit = self._granted_hit(request.request_id, prompt, grant)
        elif self._store is not None:
            hit = self._store_hit(request.request_id, prompt)
        else:
            self._source.sync()
            hit = self._catalog.best(prompt, self._block_size, self.settings.min_tokens)
        if hit is None or hit.tokens <= num_computed_tokens:
            return 0, False
        self._hits[request.request_id] = hit
        return hit.tokens - num_computed_tokens, False

    def _store_hit(self, req_id: str, prompt: list[int]) -> _StoreHit | None:
        """The chunk store's best match, block-aligned, when it fits the engine (one index lookup)."""
        assert self._store is not None
        began, cpu = time.perf_counter(), time.thread_time()
        PROCESS_STAND_ASIDE.hold(self)  # this process's tier's background work waits for the lookup
        try:
            match = self._store.lookup(prompt)
        finally:
            PROCESS_STAND_ASIDE.release(self)
        logger.info(  # the CPU part tells work here from waiting on the store
            "kvcdn: request %s: store lookup %.1f ms (%.1f ms CPU here), %d tokens matched",
            req_id,
            (time.perf_counter() - began) * 1000,
            (time.thread_time() - cpu) * 1000,
            match.prefix_tokens if match is not None else 0,
        )
        self._stored_prefix[req_id] = match.prefix_tokens if match is not None else 0
        if match is None:
            return None
        return self._fitting_hit(match, prompt)

    def _granted_hit(self, req_id: str, prompt: list[int], grant: dict) -> _StoreHit | None:
        """The artifact a hosted ``infer`` handed over with the request (``kvcdn_grant``: its
        record and a signed URL per object), instead of a lookup: the engine reads what the server
        authorized for this request, with no credential of its own. Never saved back."""
        from kvcdn_core.store.record import ArtifactRecord

        if not isinstance(self._store, chunks.IndexLookup):
            _warn(f"request {req_id} carries a kvcdn grant, but the connector's store is not a hosted service")
            return None
        try:
            record = ArtifactRecord.from_json(json.dumps(grant["record"]).encode(), "the grant's record")
            urls = {str(k): str(v) for k, v in dict(grant["urls"]).items()}
        except (KvcdnError, KeyError, TypeError, ValueError) as exc:
            _warn(f"request {req_id}: unreadable kvcdn grant ({str(exc).splitlines()[0]})")
            return None
        if record.root != self._store.root:
            self._store._warn_once(f"skipping granted artifact '{record.name}': made by another model or dtype")
            return None
        return self._fitting_hit(chunks.Match(record.name, record.token_count, record, urls), prompt)

    def _loadable(self, prompt: list[int], matched: int) -> int:
        """How many of ``matched`` tokens a load may fill: whole blocks, one prompt token left to compute."""
        return min(matched, len(prompt) - 1) // self._block_size * self._block_size

    def _fitting_hit(self, match: chunks.Match, prompt: list[int]) -> _StoreHit | None:
        """``match`` cut to whole blocks (one prompt token left to compute), when it fits the engine."""
        assert self._store is not None
        tokens = self._loadable(prompt, match.prefix_tokens)
        if tokens < max(self.settings.min_tokens, 1):
            return None
        try:
            check_fits(match.record.parsed_header(), self._shape, hashes=False)
        except KvcdnError as exc:
            self._store._warn_once(f"skipping stored artifact '{match.name}': {str(exc).split(': ', 1)[-1]}")
            return None
        return _StoreHit(match.name, tokens, match)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        hit = self._hits.pop(req_id, None)
        prompt = list(request.prompt_token_ids or [])
        loaded = None
        if num_external_tokens > 0 and hit is not None:
            start = hit.tokens - num_external_tokens
            plan = (
                chunks.plan(hit.match.record, start, hit.tokens, hit.match.locations)
                if isinstance(hit, _StoreHit)
                else None
            )
            self._loads[req_id] = LoadJob(req_id, hit.path, start, hit.tokens, prompt[: hit.tokens], chunks=plan)
            self._loaded[req_id] = (num_external_tokens, hit.path)
            loaded = (start, hit.tokens) if plan is not None else None
        stored = self._stored_prefix.pop(req_id, 0)
        if (
            self._can_save
            and req_id not in self._pending_saves
            and len(prompt) >= self.settings.min_tokens
            and _plain_text_request(request)
            and _grant_of(request) is None
            and not (stored >= len(prompt) if self._store is not None else self._catalog.holds(prompt))
        ):
            self._pending_saves[req_id] = _Pending(prompt)
        pending = self._pending_saves.get(req_id)
        if pending is not None:  # (again, for a preempted request resumed): what this admission loads
            pending.loaded = loaded
            if loaded is not None:
                self._loads[req_id].keep = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvcdnMetadata:
        meta = KvcdnMetadata(preempted=set(scheduler_output.preempted_req_ids or ()))
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            job = self._loads.pop(new.req_id, None)
            if job is not None:
                job.block_ids = list(new.block_ids[0])
                meta.loads.append(job)
            self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            job = self._loads.pop(req_id, None)
            if job is not None and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                job.block_ids = list(cached.new_block_ids[i][0])  # a resumed request's whole block list
                meta.loads.append(job)
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: KvcdnMetadata, req_id: str, computed_after_step: int) -> None:
        pending = self._pending_saves.get(req_id)
        if pending is None or computed_after_step < len(pending.prompt_ids) or self._kv_cache_manager is None:
            return
        del self._pending_saves[req_id]
        blocks = list(self._kv_cache_manager.get_block_ids(req_id)[0])
        meta.saves.append(SaveJob(req_id, pending.prompt_ids, blocks, pending.loaded))
        if self._gather_after_forward:
            self._blocks_held.add(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._pending_saves.pop(req_id, None)
        self._stored_prefix.pop(req_id, None)
        # a save gathered after the forward: vLLM keeps the blocks until the worker reports it
        hold = req_id in self._blocks_held
        self._blocks_held.discard(req_id)
        loaded = self._loaded.pop(req_id, None)
        figures = self._figures.pop(req_id, None)
        if loaded is None:
            return hold, None
        params: dict[str, Any] = {"kvcdn_loaded_tokens": loaded[0], "kvcdn_artifact": loaded[1]}
        if figures:
            params.update({f"kvcdn_{k}": v for k, v in figures.items()})
        elif self._store is not None:
            self._unfilled[req_id] = params
        return hold, params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Keep each loaded request's figures for its ``kv_transfer_params``. A request that ends in
        the step that loads it (``max_tokens=1``) has already had :meth:`request_finished`: vLLM
        calls that, then this with the same step's worker output, in one ``update_from_output``,
        and sends the request's output only after both; so its figures go into the params dict it
        was given, in place."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvcdnWorkerMeta):
            for req_id, figures in meta.figures.items():
                params = self._unfilled.pop(req_id, None)
                if params is not None:
                    params.update({f"kvcdn_{k}": v for k, v in figures.items()})
                elif req_id in self._loaded:
                    self._figures[req_id] = figures
        self._unfilled.clear()  # their figures came with this step's output, or never will (a failed load)

    # ==== worker side =============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn each attention layer's block layout, once per distinct cache geometry."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        layers = self._vllm_config.compilation_config.static_forward_context
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        total = self._shape.num_kv_heads
        by_geometry: dict[tuple, paged.BlockLayout] = {}
        for name, kv in kv_caches.items():
            layer = layers.get(name)
            own = getattr(layer, "kv_cache", None) if layer is not None else None
            kv = own if isinstance(own, torch.Tensor) else kv_caches[name]
            if layer is None or not hasattr(layer, "num_kv_heads"):
                continue
            heads, head_size = int(layer.num_kv_heads), int(layer.head_size)
            backend = _backend_name(layer)
            key = (tuple(kv.shape), tuple(kv.stride()), kv.dtype, backend, getattr(layer, "isa", None))
            if key not in by_geometry:
                by_geometry[key] = _layout_for(layer, kv, backend, heads, head_size)
            self._layouts[name] = by_geometry[key]
            self._caches[name] = kv
            self._heads = head_selection(total, heads, tp, rank)
        if not self._layouts:
            raise paged.LayoutError("kvcdn connector: the engine registered no attention layer caches")
        some = next(iter(self._layouts.values()))
        if self._block_size % some.block_size:
            raise paged.LayoutError(
                f"kvcdn connector: scheduler blocks of {self._block_size} tokens do not "
                f"split into kernel blocks of {some.block_size}"
            )
        self._kernel_ratio = self._block_size // some.block_size

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcdnMetadata)
        self._finish_layer_copies()
        planned = [p.digest for job in meta.loads if job.chunks is not None for p in job.chunks.parts]
        if self._tier is not None and planned:  # no fetch of this step evicts a chunk it planned
            self._tier.pin(planned)
            self._tier.stand_aside.hold(self)  # until this step's copies and checks end (_finish_layer_copies)
        try:
            self._load_all(meta)
        finally:
            if self._tier is not None and planned:
                self._tier.unpin(planned)
        if self._layer_copies:
            assert self._loader is not None  # a chunk store's worker has both
            layers = sorted(self._caches, key=_layer_index)  # the forward's order
            self._step_copies = LayerCopies(self._layer_copies, self._heads, self._copy_failed, LOAD_ERRORS)
            self._loader.start(layers, self._copy_layer, then=self._check_fetched)

    def _load_all(self, meta: KvcdnMetadata) -> None:
        for job in meta.loads:
            self._kept.pop(job.req_id, None)
            try:
                self._load(job)
            except LOAD_ERRORS as exc:
                for _, jobs in self._to_check.values():  # failed already: its chunks' checks fail nothing
                    if job in jobs:
                        jobs.remove(job)
                self._load_failed(job, exc)

    def _load_failed(self, job: LoadJob, exc: Exception) -> None:
        """One warning line; vLLM recomputes the job's blocks (reported after the forward)."""
        self._kept.pop(job.req_id, None)
        detail = str(exc).removeprefix(f"{job.path}: ")
        _warn(f"skipping {job.path} for request {job.req_id}: {detail}; vLLM recomputes those tokens")
        first = job.start // self._block_size
        last = -(-job.end // self._block_size)
        self._failed_blocks.update(job.block_ids[first:last])

    def _load(self, job: LoadJob) -> None:
        if job.chunks is not None:
            self._load_chunks(job, job.chunks)
            return
        tensors = self._read_artifact(job.path)
        ids = tensors[artifact.TOKEN_IDS]
        if ids.numel() < job.end or ids[: job.end].tolist() != job.prompt_ids[: job.end]:
            raise KvcdnError(f"{job.path}: its tokens no longer match the prompt's first {job.end}")
        slots = self._slots(job.block_ids, job.end, job.start)
        for name, kv in self._caches.items():
            index = _layer_index(name)
            keys = tensors[layer_tensor_name(index, "key")][0, self._heads, job.start : job.end]
            values = tensors[layer_tensor_name(index, "value")][0, self._heads, job.start : job.end]
            paged.scatter(kv, slots(name, kv), keys, values)

    def _load_chunks(self, job: LoadJob, plan: chunks.ChunkPlan) -> None:
        """Copy tokens ``[start, end)`` from the planned chunks, taken through the local tier (the
        tier checked each chunk's digest where it entered: no second hash here). Under the forward,
        each layer is copied once every part's bytes of it have arrived (a chunk's first layers
        while its last ones are still being fetched); a load kept for a save waits for its chunks
        and checks them first."""
        assert self._tier is not None and self._store is not None
        self._store.locate(plan)
        arrivals = self._tier.arrive_all([(p.digest, p.bytes) for p in plan.parts])
        self._arriving.append((job, plan, arrivals))
        for part in plan.parts:  # each fetched one checked beside the forward (_check_fetched)
            jobs = self._to_check.setdefault(part.digest, (part.bytes, []))[1]
            if not job.keep:  # a kept load's chunks are checked before its copy, here
                jobs.append(job)
        if job.keep:  # the request is to be saved: its loaded rows are kept whole for the save
            got = []
            for part, arrival in zip(plan.parts, arrivals):
                got.append((part, arrival.wait_settled()))
                self._tier.admit(part.digest, part.bytes)
            self._kept[job.req_id] = self._copy_kept(job, plan, got)
        else:  # copied layer by layer under the forward (kvcdn_vllm.layers)
            self._layer_copies.extend(self._part_copies(job, plan, arrivals))

    def _count_loads(self) -> None:
        """The figures of this step's chunk loads, their chunks settled: per request (sent back in
        ``kv_transfer_params``), in the totals, and one log line each."""
        loads, self._arriving = self._arriving, []
        counted: set[int] = set()  # a chunk fetched once for two loads: the second took it from memory
        for job, plan, arrivals in loads:
            figures = {"matched_tokens": job.end, "chunks_memory": 0, "chunks_disk": 0, "chunks_remote": 0}
            figures["bytes_fetched"] = 0
            for arrival in arrivals:
                if arrival.where is None or not arrival.settled:
                    continue
                where = MEMORY if id(arrival) in counted else arrival.where
                counted.add(id(arrival))
                figures[f"chunks_{where}"] += 1
                figures["bytes_fetched"] += arrival.size if where == REMOTE else 0
            self._step_figures[job.req_id] = figures
            for key, value in figures.items():
                self._totals[key] = self._totals.get(key, 0) + value
            logger.info(
                "kvcdn: request %s loaded %d tokens of '%s' (chunks: %d memory, %d disk, %d remote; %d bytes fetched)",
                job.req_id,
                job.end - job.start,
                plan.name,
                figures["chunks_memory"],
                figures["chunks_disk"],
                figures["chunks_remote"],
                figures["bytes_fetched"],
            )

    def _part_copies(self, job: LoadJob, plan: chunks.ChunkPlan, arrivals: list[Arrival]) -> list[PartCopy]:
        """What :meth:`_copy_layer` needs of each part that holds some of tokens ``[start, end)``."""
        copies = []
        for part, arrival in zip(plan.parts, arrivals):
            start, end = max(job.start, part.start), min(job.end, part.start + part.tokens)
            if start < end:
                copies.append(PartCopy(job, plan, part, arrival, start, end, self._slots(job.block_ids, end, start)))
        return copies

    def _copy_layer(self, name: str) -> None:
        """The loader thread's work for one layer: every part of this step that did not fail yet."""
        assert self._step_copies is not None
        self._step_copies.copy_layer(name, self._caches[name], _layer_index(name), self._layouts[name])

    def _check_fetched(self) -> None:
        """Check the digests of the chunks this step fetched and copied unchecked (the loader thread's
        last work, beside the forward), letting each into the tier; a chunk that fails fails the
        requests that copied it: one line each, and vLLM recomputes their blocks."""
        assert self._tier is not None
        while self._to_check:
            digest, (size, jobs) = self._to_check.popitem()
            try:
                self._tier.admit(digest, size)
            except LOAD_ERRORS as exc:
                for job in jobs:
                    self._copy_failed.setdefault(job.req_id, (job, exc))

    def _finish_layer_copies(self) -> None:
        """Wait for the copies under the forward and their checks, then report the requests whose
        copy or check failed."""
        if self._loader is not None:
            self._loader.finish()
        if self._to_check:  # a step whose copies did not run (a load that failed before them)
            self._check_fetched()
        self._count_loads()
        self._layer_copies, self._step_copies = [], None
        if self._tier is not None:
            self._tier.stand_aside.release(self)  # the tier's disk copies and buffers may run now
        failed, self._copy_failed = self._copy_failed, {}
        for job, exc in failed.values():
            self._load_failed(job, exc)

    def _copy_kept(self, job: LoadJob, plan: chunks.ChunkPlan, got: list[tuple[chunks.Part, ChunkBytes]]) -> _Kept:
        """Copy tokens ``[start, end)`` into the blocks through one tensor per layer, kept for the
        request's save (this worker's heads: all of them, without tensor parallelism)."""
        tensors = chunks.slices(plan, got, job.start, job.end)
        slots = self._slots(job.block_ids, job.end, job.start)
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, kv in self._caches.items():
            index = _layer_index(name)
            keys = tensors[layer_tensor_name(index, "key")][self._heads]
            values = tensors[layer_tensor_name(index, "value")][self._heads]
            paged.scatter(kv, slots(name, kv), keys, values)
            layers[index] = (keys, values)
        return _Kept(job.start, job.end, layers)

    def build_connector_worker_meta(self) -> KvcdnWorkerMeta | None:
        if not self._step_figures:
            return None
        meta, self._step_figures = KvcdnWorkerMeta(self._step_figures), {}
        return meta

    def _slots(self, block_ids: list[int], end: int, start: int = 0) -> Callable[[str, torch.Tensor], paged.TokenSlots]:
        """``slots(layer_name, kv) -> TokenSlots``, computed once per distinct layout of the request."""
        blocks = self._kernel_blocks(block_ids)
        known: dict[int, paged.TokenSlots] = {}

        def slots(name: str, kv: torch.Tensor) -> paged.TokenSlots:
            layout = self._layouts[name]
            if id(layout) not in known:
                known[id(layout)] = paged.token_slots(layout, blocks, end, start, kv.device)
            return known[id(layout)]

        return slots

    def _read_artifact(self, path: str) -> dict[str, torch.Tensor]:
        """The artifact's tensors, dequantized; the last one read is kept for the next request."""
        import os

        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns, st.st_ino)
        if self._artifact_cache is not None and self._artifact_cache[0] == key:
            return self._artifact_cache[1]
        header = artifact.read_header(path)
        if header.manifest.get("quantization"):
            from kvcdn_core import dequantize_tensors

            tensors = dequantize_tensors(header, "cpu", verify_hashes=True)
        else:
            tensors = artifact.load_tensors(header, verify_hashes=True)
        self._artifact_cache = (key, tensors)
        return tensors

    def _kernel_blocks(self, block_ids: list[int]) -> list[int]:
        """Scheduler block ids → the kernel's blocks (a scheduler block may span several)."""
        r = self._kernel_ratio
        return [b * r + i for b in block_ids for i in range(r)]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Chunk loads are copied layer by layer under the forward; the rest in start_load_kv."""
        if self._loader is not None:
            self._loader.wait(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._gatherer is not None:  # gathered after the forward (wait_for_save)
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcdnMetadata) or not meta.saves or layer_name not in self._layouts:
            return
        index = _layer_index(layer_name)
        for job in meta.saves:
            if job.req_id not in self._save_rows:
                self._save_rows[job.req_id] = self._rows_to_copy(job, kv_layer)
            rows = self._save_rows[job.req_id]
            if rows is None:
                continue
            try:
                parts = [paged.gather(kv_layer, slots(layer_name, kv_layer)) for slots in rows.slots]
            except (paged.LayoutError, ValueError) as exc:
                _warn(f"not saving request {job.req_id}: {exc}")
                self._save_rows[job.req_id] = None
                continue
            self._gathered.setdefault(job.req_id, {})[index] = [(k.cpu(), v.cpu()) for k, v in parts]

    def _drop_save(self, rows: _SaveRows) -> None:
        """A save given up after its shared memory was set aside: the memory goes back."""
        if rows.handover is not None and self._saver is not None:
            self._saver.drop(rows.handover)

    def _rows_to_copy(self, job: SaveJob, kv_layer: torch.Tensor) -> _SaveRows | None:
        """What a save copies out of the blocks: the whole prompt, or, when the connector loaded
        tokens ``[start, end)`` of it from the store, only ``[0, start)`` (vLLM's own cache) and
        ``[end, n)`` (computed): the loaded rows are the chunks' bytes, kept at the load. None (one
        line, no save) when the load failed: its blocks were not written."""
        n = len(job.prompt_ids)
        whole = _SaveRows([(0, n)], [self._slots(job.block_ids, n)], None)
        kept = self._kept.pop(job.req_id, None)
        if job.loaded is None:
            rows = whole
        elif kept is None or (kept.start, kept.end) != job.loaded:
            _warn(f"not saving request {job.req_id}: the prefix it was to load from the store is not in its blocks")
            return None
        elif self._heads_gather is not None or any(k.dtype != kv_layer.dtype for k, _ in kept.layers.values()):
            # under tensor parallelism the ranks' heads are gathered whole; and a cache of another
            # dtype converted the loaded rows: copy what the blocks hold
            rows = whole
        else:
            ranges = [r for r in ((0, kept.start), (kept.end, n)) if r[1] > r[0]]
            rows = _SaveRows(ranges, [self._slots(job.block_ids, b, a) for a, b in ranges], kept)
        if self._gatherer is not None:  # gathered straight into the save queue's shared memory
            assert self._saver is not None
            shape = self._shape
            size = 2 * shape.num_layers * n * shape.num_kv_heads * shape.head_size * kv_layer.dtype.itemsize
            rows.handover = self._saver.hand_over(artifact_name(job.prompt_ids).removesuffix(".kv"), size)
            if rows.handover is None:  # the queue is full (said so)
                return None
        return rows

    def wait_for_save(self) -> None:
        """Hand this step's saves to the save queue. On a chunk store with one worker the prompts
        are gathered here, after the forward, by a thread of its own: the first token does not wait
        for the copy (about 50 ms for 2,300 SmolLM2 tokens), and the copy releases Python's lock.
        vLLM keeps the blocks until :meth:`get_finished` reports the gather done, and a preemption
        waits for it (:meth:`handle_preemptions`): nothing overwrites rows being read."""
        self._finish_layer_copies()  # every layer was waited for by now; the gathers read blocks
        meta = self._connector_metadata
        if not isinstance(meta, KvcdnMetadata) or not meta.saves:
            return
        if self._gatherer is not None:
            self._start_gathers(meta.saves)
            return
        # no entry: no layer of this worker gathered it (then "0 of N layers" below)
        rows_of = {job.req_id: self._save_rows.pop(job.req_id, _SaveRows([], [], None)) for job in meta.saves}
        # a prompt with no rows to save (its load failed) has no layers: under tensor parallelism
        # the gather then skips it on every rank
        prompts = {
            req_id: self._gathered.pop(req_id, {}) if rows is not None else {} for req_id, rows in rows_of.items()
        }
        counts = {req_id: len(layers) for req_id, layers in prompts.items()}
        whole: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None = None
        if self._heads_gather is not None:  # every TP rank's heads, assembled on the first rank
            began = time.perf_counter()
            joined = {
                req_id: _joined(layers, rows) if rows is not None else {}
                for (req_id, layers), rows in zip(prompts.items(), rows_of.values())
            }
            whole = self._heads_gather.whole(joined, self._shape.num_layers)
            if not self._heads_gather.first:
                return
            logger.info(
                "kvcdn: gathered %d prompts' heads from %d tensor-parallel workers in %.1f ms",
                len(whole),
                len(self._heads_gather.ranks),
                (time.perf_counter() - began) * 1000,
            )
        for job in meta.saves:
            rows = rows_of[job.req_id]
            if rows is None:  # said so in save_kv_layer
                continue
            if counts[job.req_id] != self._shape.num_layers:
                _warn(
                    f"not saving request {job.req_id}: {counts[job.req_id]} of {self._shape.num_layers} layers gathered"
                )
                continue
            if whole is not None and job.req_id not in whole:
                _warn(f"not saving request {job.req_id}: another tensor-parallel worker did not gather its layers")
                continue
            self._log_save(job, rows)

            if self._saver is not None:  # a chunk store under tensor parallelism: every worker's heads
                assert whole is not None
                heads = {index: [pair] for index, pair in whole[job.req_id].items()}
                self._saver.save(artifact_name(job.prompt_ids).removesuffix(".kv"), job.prompt_ids, heads)
                continue
            layers = whole[job.req_id] if whole is not None else _joined(prompts[job.req_id], rows)
            try:
                model = SavedModel.of_engine(self._vllm_config, self._model_dir, self._fingerprint)
                path = write_prompt_artifact(self._source.directory, model, job.prompt_ids, layers)
                self._source.publish(path)
                logger.info("kvcdn: saved %d prompt tokens to %s", len(job.prompt_ids), path)
            except (KvcdnError, OSError) as exc:
                _warn(f"not saving request {job.req_id}: {exc}")

    def _start_gathers(self, saves: list[SaveJob]) -> None:
        assert self._gatherer is not None
        some_layer = next(iter(self._caches.values()))
        for job in saves:
            rows = self._rows_to_copy(job, some_layer)  # in step: it takes the rows kept at the load
            self._gathers[job.req_id] = None if rows is None else self._gatherer.submit(self._gather, job, rows)

    def _gather(self, job: SaveJob, rows: _SaveRows) -> None:
        """The gather thread: every layer's rows into the save's shared memory, then the save."""
        assert self._saver is not None and rows.handover is not None
        if sorted(_layer_index(name) for name in self._layouts) != list(range(self._shape.num_layers)):
            _warn(f"not saving request {job.req_id}: this worker does not hold every layer's cache")
            self._drop_save(rows)
            return
        try:
            for name in self._layouts:
                index, kv = _layer_index(name), self._caches[name]
                for _start, i in rows.in_token_order():
                    if i is None:
                        assert rows.kept is not None
                        rows.handover.copy(index, *rows.kept.layers[index])
                    else:
                        slots = rows.slots[i](name, kv)
                        keys, values = rows.handover.room(index, slots.shape, kv.dtype)
                        paged.gather_into(kv, slots, keys, values)
            self._log_save(job, rows)
            self._saver.submit(rows.handover, job.prompt_ids)
        except Exception as exc:  # a thread's failure: one line, no request fails (get_finished waits on it)
            _warn(f"not saving request {job.req_id}: {exc}")
            self._drop_save(rows)

    def _log_save(self, job: SaveJob, rows: _SaveRows) -> None:
        copied = sum(b - a for a, b in rows.ranges)
        logger.info(
            "kvcdn: request %s: saving %d prompt tokens, %d copied from its blocks, %d from the chunks it loaded",
            job.req_id,
            len(job.prompt_ids),
            copied,
            len(job.prompt_ids) - copied,
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before vLLM reuses a preempted request's blocks (this step may write them): its gather
        must be done reading them."""
        if isinstance(kv_connector_metadata, KvcdnMetadata):
            for req_id in kv_connector_metadata.preempted & self._gathers.keys():
                gather, began = self._gathers[req_id], time.perf_counter()
                if gather is not None:
                    gather.result()
                logger.info(
                    "kvcdn: request %s preempted after its save began: its gather was done before its blocks "
                    "went back (waited %.1f ms)",
                    req_id,
                    (time.perf_counter() - began) * 1000,
                )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Drop the rows kept for the save of a request that finished without it, and report the
        finished requests whose save was gathered after the forward (once it is done: vLLM then
        frees their blocks). It waits for a gather still running, so a request is reported in the
        step that tells the worker it finished, even on an engine that then goes idle."""
        for req_id in finished_req_ids:
            self._kept.pop(req_id, None)
        done = set()
        for req_id in finished_req_ids & self._gathers.keys():
            gather = self._gathers.pop(req_id)
            if gather is not None:
                gather.result()
            done.add(req_id)
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_copies()  # wait_for_save may be deferred (a draft model's forward)
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _saved(self, name: str, report: Any) -> None:
        logger.info(
            "kvcdn: saved %d prompt tokens as '%s' (%d of %d chunks new, %d bytes uploaded)",
            report.tokens,
            name,
            report.chunks_new,
            report.chunks,
            report.bytes_moved,
        )

    def shutdown(self) -> None:
        """Finish the queued saves, then log the tier's totals once (the engine's exit summary)."""
        if self._loader is not None:
            self._loader.close()
        if self._gatherer is not None:
            self._gatherer.shutdown(wait=True)  # the gathers hand their saves over first
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()
        if self._tier is not None:
            self._tier.close()  # the queued disk copies, so that the next start finds them
        if self._tier is not None and (self._totals or saver is not None):
            t = self._totals
            logger.info(
                "kvcdn: summary: %d tokens loaded; chunks %d memory, %d disk, %d remote; %d bytes fetched; "
                "saves %d done, %d skipped (queue full), %d failed; %d chunks warmed from disk at start; "
                "%d chunks read from disk after waiting for another process's fetch",
                t.get("matched_tokens", 0),
                t.get("chunks_memory", 0),
                t.get("chunks_disk", 0),
                t.get("chunks_remote", 0),
                t.get("bytes_fetched", 0),
                saver.saved if saver else 0,
                saver.skipped if saver else 0,
                saver.failed if saver else 0,
                self._tier.warmed,
                self._tier.fetches_shared,
            )


#: what makes a load of one request fail (one line, its blocks recomputed), never the step
LOAD_ERRORS = (KvcdnError, paged.LayoutError, OSError, KeyError, RuntimeError, ValueError)


@dataclasses.dataclass(frozen=True)
class _StoreHit:
    """A chunk store's match for a request: ``tokens`` block-aligned, ``path`` the artifact's name."""

    path: str
    tokens: int
    match: chunks.Match


def _joined(
    gathered: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], rows: _SaveRows
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's whole prompt: the ranges copied from the blocks and the kept loaded rows, in
    token order (without the save queue: a source directory, and tensor parallelism's gather)."""
    layers = {}
    for index, parts in gathered.items():
        pieces = [parts[i] if i is not None else rows.kept.layers[index] for _start, i in rows.in_token_order()]  # type: ignore[union-attr]
        if len(pieces) == 1:
            layers[index] = pieces[0]
        else:
            layers[index] = (torch.cat([k for k, _ in pieces], dim=1), torch.cat([v for _, v in pieces], dim=1))
    return layers


def _grant_of(request: Request) -> dict | None:
    """The ``kvcdn_grant`` a hosted ``infer`` put in the request's ``kv_transfer_params``, if any."""
    params = getattr(request, "kv_transfer_params", None)
    grant = params.get("kvcdn_grant") if isinstance(params, dict) else None
    return grant if isinstance(grant, dict) else None


def _plain_text_request(request: Request) -> bool:
    """Token-id prompts of the base model: images, prompt embeddings or LoRA change the cache."""
    return not (
        getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
        or getattr(request, "lora_request", None)
    )


def _layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def _backend_name(layer: Any) -> str:
    backend = getattr(layer, "attn_backend", None)
    try:
        return str(backend.get_name()) if backend is not None else ""
    except Exception:
        return ""


def _layout_for(layer: Any, kv: torch.Tensor, backend: str, heads: int, head_size: int) -> paged.BlockLayout:
    """The CPU backend's layout is probed through its own cache write; others follow their strides."""
    if backend == "CPU_ATTN":
        impl = layer.impl

        def write(keys: torch.Tensor, values: torch.Tensor, scratch: torch.Tensor, slots: torch.Tensor) -> None:
            impl.do_kv_cache_update(layer, keys, values, scratch, slots)

        return paged.probe_layout(kv, heads, head_size, write)
    return paged.strided_layout(kv, head_size)
