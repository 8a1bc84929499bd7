"""Copies a step's loaded chunks into vLLM's blocks layer by layer, under the forward.

Why: a chunk holds every layer of its tokens, so a load that copies chunk after chunk finishes the
last layer when it finishes the first, and the forward waited for all of it (50-75 ms for 2,048
SmolLM2 tokens in the fleet benchmark, on an APC-hit first token of 0.14-0.25 s). Here one thread of
the worker copies every planned part's rows of layer 0, then of layer 1, and so on, while the
forward runs: vLLM calls the connector's ``wait_for_layer_load`` before each attention layer reads
its cache, and that waits only for the layer it names. The copies release Python's lock, so they
run on another core where one is free, and at worst in turn with the forward. A chunk still being
fetched is copied as its bytes arrive: a layer's copy waits only for that layer's bytes
(:class:`PartCopy`, over a :class:`kvcdn_vllm.tier.Arrival`), so the forward also starts before the fetches end.

Each layer but the first is copied in a handful of torch calls, whatever the number of parts
(:class:`LayerCopies`: one ``torch._foreach_copy_`` of every part's runs of whole blocks; the first
is copied part by part, so that the forward's first layer does not wait for the parts to be cut
into every layer's runs). Every torch call lets go of
Python's lock and takes it back, and vLLM's forward on the engine's thread is Python between its
kernels: with a call or four per part and layer (480-4,800 a request for 2,048 SmolLM2 tokens), a
Python-heavy forward beside the copies took 9-22 ms longer; with one call per layer, 1-4 ms, the
same copies (a throwaway harness; docs/benchmarks.md).

A layer's copy of one request failing skips that request's later layers (the caller's ``copy``
says so by raising); the forward is never left waiting: every layer is marked ready when the thread
ends, however it ends. :meth:`LayerLoader.finish` waits for the thread; the connector calls it
before anything reads the blocks or the figures again (the gathers after the forward, the failed
blocks, the next step's loads, shutdown).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvcdn_core.artifact import layer_tensor_name
from kvcdn_vllm.layout import BlockLayout, LayoutError, TokenSlots, block_runs, blocks_in_cache, flat_view, scatter
from kvcdn_vllm.lookup import ChunkPlan, Part, byte_spans, view_bytes
from kvcdn_vllm.tier import Arrival


class LayerLoader:
    """One thread that runs ``copy(layer)`` for each layer in the forward's order."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvcdn-load")
        self._ready: dict[str, threading.Event] = {}
        self._running: Future | None = None

    def start(self, layers: Sequence[str], copy: Callable[[str], None], then: Callable[[], None] | None = None) -> None:
        """Copy ``layers`` in order on the thread, then run ``then`` (work the forward need not wait
        for: the digest checks of chunks fetched for this step); the previous step's are finished first."""
        self.finish()
        ready = {name: threading.Event() for name in layers}

        def run() -> None:
            try:
                for name in layers:
                    copy(name)
                    ready[name].set()
            finally:  # whatever happened, no layer is left waited for
                for event in ready.values():
                    event.set()
            if then is not None:
                then()

        self._ready = ready
        self._running = self._thread.submit(run)

    def wait(self, layer: str) -> None:
        """Return once ``layer`` is in the blocks (at once for a layer this step does not load)."""
        event = self._ready.get(layer)
        if event is not None:
            event.wait()

    def finish(self) -> None:
        """Wait for the running copies; an error ``copy`` did not handle is raised here."""
        running, self._running = self._running, None
        self._ready = {}
        if running is not None:
            running.result()

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self._thread.shutdown(wait=True)


class PartCopy:
    """One part's share of a load (``job``, the connector's): its bytes as they arrive, and where its
    rows go. Its rows of every layer are cut in a few calls (:meth:`grouped`), or made one layer at a
    time (:meth:`views`): for the step's first layer, so that the forward's first layer does not wait
    for views of all the others (60 per SmolLM2 chunk), and for every layer of a part that cannot be
    grouped."""

    def __init__(
        self,
        job: Any,
        plan: ChunkPlan,
        part: Part,
        arrival: Arrival,
        start: int,
        end: int,
        slots: Callable[[str, torch.Tensor], TokenSlots],
    ):
        self.job, self.slots = job, slots
        self._arrival, self._rows = arrival, slice(start - part.start, end - part.start)
        self._spans = byte_spans(plan, part)
        self._bytes: torch.Tensor | None = None

    def wait_layer(self, index: int) -> None:
        """Return once layer ``index``'s keys and values have landed (or raise the fetch's error)."""
        key, value = self._spans[layer_tensor_name(index, "key")], self._spans[layer_tensor_name(index, "value")]
        self._arrival.wait(max(key[1], value[1]))

    def grouped(self, slots: TokenSlots, heads: slice, dtype: torch.dtype) -> Grouped | None:
        """This part's rows of every layer at once, cut where ``slots`` places them, in a few torch
        calls: None when its tensors are not all ``dtype`` of one shape (then :meth:`views`, layer by
        layer). Views only: each layer is read after :meth:`wait_layer`."""
        order = _uniform_order(self._spans, dtype)
        if order is None:
            return None
        outer, tokens, last = next(iter(self._spans.values()))[3]
        typed = view_bytes(self._arrival.wait(1), dtype)  # the buffer the bytes land in
        mine = typed[: len(order) * outer * tokens * last].view(len(order), outer, tokens, last)[:, heads, self._rows]
        if (mine.shape[1], mine.shape[3]) != (slots.shape[0], slots.shape[2]):  # as scatter refuses them
            raise LayoutError(f"rows of {list(mine.shape[1:])} do not fit {list(slots.shape)} slots")
        keys = [order[layer_tensor_name(i, "key")] for i in range(len(order) // 2)]
        values = [order[layer_tensor_name(i, "value")] for i in range(len(order) // 2)]

        def by_layer(every: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
            return tuple(every[k] for k in keys), tuple(every[v] for v in values)

        bs = slots.layout.block_size
        runs = [
            BlockRun(
                block,
                count,
                *by_layer(mine[:, :, t : t + count * bs].unflatten(2, (count, bs)).transpose(1, 2).unbind(0)),
            )
            for t, block, count in block_runs(slots)
        ]
        rows = [
            BlockRows(block, row, count, *by_layer(mine[:, :, t : t + count].unbind(0)))
            for block, row, count, t in slots.pieces[1]
        ]
        return Grouped(runs, rows)

    def views(self, *names: str) -> list[torch.Tensor]:
        """The ``names`` tensors' rows as ``[outer, tokens, last]`` views, once their bytes arrived."""
        data = self._arrival.wait(max(self._spans[name][1] for name in names))
        if self._bytes is None:
            self._bytes = view_bytes(data, torch.uint8)
        views = []
        for name in names:
            begin, end, dtype, shape = self._spans[name]
            if begin % dtype.itemsize:  # not aligned for a view of the bytes (mixed dtypes)
                whole = view_bytes(data, dtype, (end - begin) // dtype.itemsize, begin)
            else:
                whole = self._bytes[begin:end].view(dtype)
            views.append(whole.view(shape)[:, self._rows])
        return views


def _uniform_order(
    spans: dict[str, tuple[int, int, torch.dtype, tuple[int, int, int]]], dtype: torch.dtype
) -> dict[str, int] | None:
    """Each tensor's place in a part whose tensors are all ``dtype`` of one shape (so the part is one
    ``[tensors, outer, tokens, last]`` array), holding layers ``0..n-1``'s keys and values; else None."""
    shapes = {(d, shape) for _, _, d, shape in spans.values()}
    if shapes != {(dtype, next(iter(spans.values()))[3])} or len(spans) % 2:
        return None
    order = {name: place for place, name in enumerate(sorted(spans, key=lambda n: spans[n][0]))}
    layers = len(spans) // 2
    wanted = {layer_tensor_name(i, role) for i in range(layers) for role in ("key", "value")}
    return order if set(order) == wanted else None


@dataclasses.dataclass(frozen=True)
class BlockRun:
    """Whole blocks ``[block, block + count)`` of one part: per layer, their keys and their values as
    ``[count, heads, block_size, head_size]`` views of the part's bytes."""

    block: int
    count: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class BlockRows:
    """``count`` rows of block ``block`` from its row ``row`` (a block the part fills in part): per layer,
    their keys and values as ``[heads, count, head_size]`` views."""

    block: int
    row: int
    count: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Grouped:
    """A part's rows of every layer, cut where they go (:meth:`PartCopy.grouped`)."""

    runs: list[BlockRun]
    rows: list[BlockRows]


class LayerCopies:
    """A step's parts copied into one layer at a time: each part grouped once (:meth:`PartCopy.grouped`),
    then per layer one ``torch._foreach_copy_`` of every part's blocks, whatever their number. A part
    that cannot be grouped (a layout that is not affine, another dtype, heads picked by index, a cache
    off the CPU) is copied on its own (:meth:`copy_part`: its views, then ``layout.scatter``).

    The first layer is copied part by part, before anything is grouped: the forward's first
    attention layer waits for it, and grouping every layer of 8 SmolLM2 chunks first took about 3 ms,
    2 of which that layer waited (the copies of the others run under the forward, grouped).

    A part whose bytes fail (a fetch that stopped, an error its copy raised) fails its request:
    ``failed[req_id] = (job, error)``, and its request's later layers are skipped, as the other
    requests' are not.
    """

    def __init__(
        self,
        copies: list[PartCopy],
        heads: slice | torch.Tensor,
        failed: dict[str, tuple[Any, Exception]],
        errors: tuple[type[Exception], ...],
    ):
        self._copies, self._heads = copies, heads
        self._failed, self._errors = failed, errors
        self._grouped: dict[tuple[int, int], Grouped | None] = {}  # (part, layout) -> grouped, once
        self._first = True

    def copy_layer(self, name: str, kv: torch.Tensor, index: int, layout: BlockLayout) -> None:
        first, self._first = self._first, False
        ready: list[Grouped] = []
        jobs = []
        for copy in self._copies:
            if copy.job.req_id in self._failed:
                continue
            try:
                grouped = None if first else self._group(copy, name, kv, layout)
                if grouped is None:
                    self.copy_part(copy, name, kv, index)
                    continue
                copy.wait_layer(index)
            except self._errors as exc:
                self._failed[copy.job.req_id] = (copy.job, exc)
                continue
            ready.append(grouped)
            jobs.append(copy.job)
        if not ready:
            return
        try:
            _copy_grouped(kv, layout, index, ready)
        except self._errors as exc:  # nothing a part did: every request of the call fails alike
            for job in jobs:
                self._failed.setdefault(job.req_id, (job, exc))

    def copy_part(self, copy: PartCopy, name: str, kv: torch.Tensor, index: int) -> None:
        """Layer ``index`` of one part, on its own, once its bytes arrived."""
        keys, values = copy.views(layer_tensor_name(index, "key"), layer_tensor_name(index, "value"))
        scatter(kv, copy.slots(name, kv), keys[self._heads], values[self._heads])

    def _group(self, copy: PartCopy, name: str, kv: torch.Tensor, layout: BlockLayout) -> Grouped | None:
        key = (id(copy), id(layout))
        if key not in self._grouped:
            heads, grouped = self._heads, None
            if isinstance(heads, slice) and layout.strides is not None and kv.device.type == "cpu":
                slots = copy.slots(name, kv)
                blocks_in_cache(kv, slots)
                grouped = copy.grouped(slots, heads, kv.dtype)
            self._grouped[key] = grouped
        return self._grouped[key]


def _copy_grouped(kv: torch.Tensor, layout: BlockLayout, index: int, parts: list[Grouped]) -> None:
    """Layer ``index`` of every grouped part into ``kv``: one ``torch._foreach_copy_`` call."""
    strides = layout.strides
    assert strides is not None
    flat = flat_view(kv)
    h, bs, d = layout.num_kv_heads, layout.block_size, layout.head_size
    runs = sorted((run for part in parts for run in part.runs), key=lambda r: r.block)
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    if runs:
        bounds = [edge for run in runs for edge in (run.block, run.block + run.count)]
        overlap = any(later.block < earlier.block + earlier.count for earlier, later in zip(runs, runs[1:]))
        for part_strides, side in zip(strides, ("keys", "values")):
            blocks = part_strides.blocks(flat, kv.shape[0], layout.block_stride, (h, bs, d))
            if overlap:  # never from the scheduler: one view per run, still one copy call
                pieces = [blocks.narrow(0, run.block, run.count) for run in runs]
            else:  # every run's view in one call: the pieces between runs are left out
                pieces = list(blocks.tensor_split(bounds)[1::2])
            dsts.extend(pieces)
            srcs.extend(getattr(run, side)[index] for run in runs)
    for part in parts:
        for rows in part.rows:
            for part_strides, side in zip(strides, ("keys", "values")):
                start = rows.block * layout.block_stride + rows.row * part_strides.token
                dsts.append(part_strides.rows(flat, start, (h, rows.count, d)))
                srcs.append(getattr(rows, side)[index])
    torch._foreach_copy_(dsts, srcs)
