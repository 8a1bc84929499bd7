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

A layer's copy of one request failing skips that request's later layers (the caller's ``copy``
says so by raising); the forward is never left waiting: every layer is marked ready when the thread
ends, however it ends. :meth:`LayerLoader.finish` waits for the thread; the connector calls it
before anything reads the blocks or the figures again (the gathers after the forward, the failed
blocks, the next step's loads, shutdown).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvcdn_vllm.layout import TokenSlots
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
    rows go. A layer's views are made when that layer is copied, so the forward's first layer does
    not wait for views of all the others (60 per SmolLM2 chunk)."""

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
