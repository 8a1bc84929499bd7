"""Load a cache layer by layer while the model already runs on the first layers.

A cached time to first token is the artifact's load plus the question's forward pass. The forward
needs layer k's cache only when it reaches layer k, so the two can overlap: a background thread
reads the layers in order, checks each layer's sha256 and imports it through the adapter, and the
cache hands layer k to the model only once layer k is in and verified. A layer that fails its check
(or cannot be read) raises :class:`ArtifactError` at the moment the model asks for it: its bytes are
never used. The cached TTFT then tends to max(read, forward) instead of their sum.

What a layer is made of is the caller's :class:`LayerSource`: a plain artifact's layer is its
stored tensors; a quantized artifact's layer is its codes, scales and residual window, dequantized
by the worker once they are verified (:class:`kvcdn_core.quant.QuantizedLayers`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from kvcdn_core.errors import ArtifactError
from kvcdn_core.manifest import LayerEntry
from kvcdn_core.tensor_io import TensorReader, as_tensor


@dataclasses.dataclass(frozen=True)
class LayerSource:
    """How an artifact's layer ``i`` (in manifest order) becomes what its cache layer takes."""

    #: The stored tensors layer ``i`` is built from: read, then sha256-checked, before ``build``.
    stored_names: Callable[[int], list[str]]
    #: ``build(i, stored)``: layer ``i``'s tensors by layer-local name, on the compute device;
    #: ``stored(name)`` is a verified stored tensor (a view on the read buffer).
    build: Callable[[int, Callable[[str], Any]], dict[str, Any]]


class LayerStream:
    """The background load of one artifact into an (initially empty) cache's layers."""

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
        self.source, self.verify, self.workers = source, verify_hashes, workers
        self.ready = [threading.Event() for _ in self.layers]
        self.errors: list[BaseException | None] = [None] * len(self.layers)
        cache.layers = GatedLayers(cache.layers, self)
        cache.__class__ = _streaming_class(type(cache))
        self.thread = threading.Thread(target=self._run, name="kvcdn-layer-stream", daemon=True)
        self.thread.start()

    # -- the consumer's side ---------------------------------------------------------------------

    def wait(self, index: int) -> None:
        """Block until layer ``index`` is usable; raise what stopped it from being so."""
        if index < 0:
            index += len(self.ready)
        if not 0 <= index < len(self.ready):
            return  # a layer the artifact does not have: the cache's own business
        self.ready[index].wait()
        error = self.errors[index]
        if error is not None:
            raise error

    def wait_all(self) -> None:
        for index in range(len(self.ready)):
            self.wait(index)

    # -- the loader's side -----------------------------------------------------------------------

    def _run(self) -> None:
        """Read the layers in order; hand each to a worker that verifies, builds and imports it."""
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvcdn-layer") as pool:
            try:
                for index, entry in enumerate(self.layers):
                    for name in sorted(self.source.stored_names(index), key=self.reader.span):
                        self.reader.fetch(*self.reader.span(name))
                    pool.submit(self._finish, index, entry)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the layer
                self._fail_from(exc)
            finally:
                self.reader.close()

    def _finish(self, index: int, entry: LayerEntry) -> None:
        try:
            if self.verify:
                bad = [name for name in self.source.stored_names(index) if not self.reader.hash_matches(name)]
                if bad:
                    raise ArtifactError(
                        f"{self.header.path}: corrupted: sha256 mismatch in layer {index} "
                        f"(tensor '{bad[0]}'); the cache was not used"
                    )
            named = self.source.build(index, lambda name: as_tensor(self.reader, name))
            self.adapter.import_layer(entry, named, self.targets[index])
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the layer
            self.errors[index] = exc
        finally:
            self.ready[index].set()

    def _fail_from(self, exc: BaseException) -> None:
        """A read failed: every layer not yet handed to a worker fails with it."""
        for index, event in enumerate(self.ready):
            if not event.is_set() and self.errors[index] is None:
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
