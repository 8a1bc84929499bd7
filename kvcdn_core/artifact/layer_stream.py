"""Load a cache layer by layer while the model already runs on the first layers.

A cached time to first token is the artifact's load plus the question's forward pass. The forward
needs layer k's cache only when it reaches layer k, so the two can overlap: a background thread
reads the layers in order, worker threads verify (its digests) and import each layer as soon as
its bytes are in, and the cache hands layer k to the model only once layer k is verified. A layer
that fails its check (or cannot be read) raises :class:`ArtifactError` at the moment the model asks
for it: its bytes are never used. Whoever gets to a layer first finishes it: when the model reaches
a layer whose bytes are in but that no worker has started, its own thread verifies and imports it
rather than wait. The cached TTFT then tends to max(read, forward) instead of their sum.

The overlap needs a core that torch's threads leave free: the workers' hashing, and the kernel's
work of reading into fresh memory, would otherwise preempt torch's threads, and every parallel
region of the forward waits for its slowest thread. :func:`kvcdn_core.runtime.load_cache` streams
only where :func:`kvcdn_core.cores.stream_workers` finds such a core (docs/benchmarks.md has the
measurements).

What a layer is made of is the caller's :class:`LayerSource`: a plain artifact's layer is its
stored tensors; a quantized artifact's layer is its codes, scales and residual window, dequantized
once they are verified (:class:`kvcdn_core.quant.codec.QuantizedLayers`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from kvcdn_core.artifact.manifest import LayerEntry
from kvcdn_core.artifact.tensor_io import TensorReader, as_tensor
from kvcdn_core.errors import ArtifactError


@dataclasses.dataclass(frozen=True)
class LayerSource:
    """How an artifact's layer ``i`` (in manifest order) becomes what its cache layer takes."""

    #: The stored tensors layer ``i`` is built from: read, then their digests checked, before ``build``.
    stored_names: Callable[[int], list[str]]
    #: ``build(i, stored)``: layer ``i``'s tensors by layer-local name, on the compute device;
    #: ``stored(name)`` is a verified stored tensor (a view on the read buffer).
    build: Callable[[int, Callable[[str], Any]], dict[str, Any]]


class LayerStream:
    """The background load of one artifact into an (initially empty) cache's layers.

    ``workers``: threads that verify and import layers as their bytes come in. Each layer is
    finished exactly once, by a worker or by the thread that asks for it, whichever comes first.
    """

    def __init__(
        self,
        adapter,
        reader: TensorReader,
        cache,
        targets: list,
        layers: Sequence[LayerEntry],
        source: LayerSource,
        verify_hashes: bool = True,
        workers: int = 1,
    ):
        self.adapter, self.reader, self.header, self.targets = adapter, reader, reader.header, targets
        self.layers = layers
        self.source, self.verify, self.workers = source, verify_hashes, max(1, workers)
        self.fetched = [threading.Event() for _ in self.layers]  # bytes in the buffer, or the read failed
        self.ready = [threading.Event() for _ in self.layers]  # verified and imported, or failed
        self.errors: list[BaseException | None] = [None] * len(self.layers)
        self._claims = [threading.Lock() for _ in self.layers]
        cache.layers = GatedLayers(cache.layers, self)
        cache.__class__ = _streaming_class(type(cache))
        self.thread = threading.Thread(target=self._run, name="kvcdn-layer-stream", daemon=True)
        self.thread.start()

    # -- the consumer's side ---------------------------------------------------------------------

    def wait(self, index: int) -> None:
        """Block until layer ``index`` is usable (finishing it here if nobody has yet); raise what
        stopped it from being so."""
        if index < 0:
            index += len(self.ready)
        if not 0 <= index < len(self.ready):
            return  # a layer the artifact does not have: the cache's own business
        if not self.ready[index].is_set():
            self.fetched[index].wait()
            self._finish(index)
        error = self.errors[index]
        if error is not None:
            raise error

    def wait_all(self) -> None:
        for index in range(len(self.ready)):
            self.wait(index)

    # -- the loader's side -----------------------------------------------------------------------

    def _run(self) -> None:
        """Read the layers in order; hand each to a worker once its bytes are in."""
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvcdn-layer")
        groups = [self.source.stored_names(index) for index in range(len(self.layers))]
        try:
            for index, error in self.reader.fetch_groups(groups):
                self.errors[index] = error  # a read that failed fails its layer, and only that one
                self.fetched[index].set()
                if error is None:
                    pool.submit(self._finish, index)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the layer
            self._fail_from(exc)
        finally:
            pool.shutdown()
            self.reader.close()

    def _finish(self, index: int) -> None:
        """Verify, build and import layer ``index``, unless someone already has."""
        with self._claims[index]:
            if self.ready[index].is_set():
                return
            try:
                if self.errors[index] is None:
                    if self.verify:
                        self._check(index)
                    named = self.source.build(index, lambda name: as_tensor(self.reader, name))
                    self.adapter.import_layer(self.layers[index], named, self.targets[index])
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the layer
                self.errors[index] = exc
            finally:
                self.ready[index].set()

    def _check(self, index: int) -> None:
        bad = [name for name in self.source.stored_names(index) if not self.reader.hash_matches(name)]
        if bad:
            raise ArtifactError(
                f"{self.header.path}: corrupted: {self.header.digest} mismatch in layer {index} "
                f"(tensor '{bad[0]}'); the cache was not used"
            )

    def _fail_from(self, exc: BaseException) -> None:
        """A read failed: every layer whose bytes are not all in fails with it."""
        for index, event in enumerate(self.fetched):
            if not event.is_set():
                self.errors[index] = exc
                event.set()


class GatedLayers(list):
    """A cache's layer list whose item k is handed out only once layer k is loaded and verified.

    Every transformers cache method reaches its layers through ``self.layers[i]`` or by iterating,
    so the gate sits there and needs no knowledge of the cache class. A deep copy (or pickle) waits
    for the whole load and yields a plain list.
    """

    def __init__(self, layers, stream: LayerStream):
        super().__init__(layers)
        self.stream = stream

    def __getitem__(self, index):
        if isinstance(index, slice):
            self.stream.wait_all()
        else:
            self.stream.wait(index)
        return super().__getitem__(index)

    def __iter__(self):
        self.stream.wait_all()
        return super().__iter__()

    def __reversed__(self):
        self.stream.wait_all()
        return super().__reversed__()

    def __deepcopy__(self, memo):
        return copy.deepcopy(list(self), memo)

    def __reduce_ex__(self, protocol):
        return list, (list(self),)

    def unchecked(self) -> list:
        """The layer objects without waiting: for questions about their types, never their contents."""
        return list.__getitem__(self, slice(None))


#: Cache properties that only look at the layers' types (fixed when the cache is made), never their contents.
#: The model asks them before its first layer (to build the attention masks); answering them
#: without the gate is what lets layer 0 start before the last layer is read.
_TYPE_ONLY_PROPERTIES = ("is_sliding", "is_linear", "is_dummy", "is_compileable", "is_croppable")
_STREAMING_CLASSES: dict[type, type] = {}


def _streaming_class(cls: type) -> type:
    """``cls`` with its type-only properties answered from the ungated layer list."""
    if cls not in _STREAMING_CLASSES:

        def type_only(fget):
            return property(lambda self: fget(SimpleNamespace(layers=_ungated(self.layers))))

        overrides = {
            name: type_only(getattr(cls, name).fget)
            for name in _TYPE_ONLY_PROPERTIES
            if isinstance(getattr(cls, name, None), property)
        }
        _STREAMING_CLASSES[cls] = type(
            cls.__name__, (cls,), {**overrides, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return _STREAMING_CLASSES[cls]


def _ungated(layers) -> list:
    return layers.unchecked() if isinstance(layers, GatedLayers) else layers
