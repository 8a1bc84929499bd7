"""Gemma 3n (``Gemma3nForCausalLM``): cross-layer KV sharing, per-layer inputs and AltUp.

The last ``num_kv_shared_layers`` layers compute no keys or values: each reuses those of the last
earlier layer of its own type (sliding or full attention), which transformers passes along during
the forward pass (``shared_kv_states``). Their cache layers are ``DummyLayer``\\ s that hold nothing,
so the artifact stores only the layers that own a cache, under their model layer ``index``; each
owner that others read from lists them in ``shared_by``. Import builds the model's cache (dummy
layers where the model shares), checks that the artifact's owners and sharing are the model's, and
fills the owners; the consumers then read the restored keys and values exactly as after a prefill.

Per-layer inputs (a second embedding table sliced per layer), AltUp (several predicted copies of the
hidden state) and LAuReL are computed from each token alone and never touch the cache, so nothing is
stored for them; the tiny configs turn them on so the validation covers them. Sliding layers make an
artifact ``whole_prefix``; a Gemma 3n whose layers are all global is croppable (``any_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcdn_core import ArtifactError, KvcdnError, LayerEntry, TinyDecoderFamily

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

SLIDING, FULL = "sliding_attention", "full_attention"


def _owns_cache(layer: Any) -> bool:
    from transformers.cache_utils import DummyLayer

    return not isinstance(layer, DummyLayer)


def sharing(config: Any) -> tuple[list[int], dict[int, list[int]]]:
    """The layers that own a cache, and owner → the later layers that reuse its keys and values."""
    modes = list(config.kv_sharing_modes)
    owners = [i for i, mode in enumerate(modes) if mode != "reuse"]
    stores = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    readers: dict[int, list[int]] = {}
    for i, mode in enumerate(modes):
        if mode == "reuse":
            readers.setdefault(stores[config.layer_types[i]], []).append(i)
    return owners, readers


_GEMMA3N = dict(
    num_hidden_layers=6,
    # Two sliding layers per global one, as Gemma 3n's 4:1 scaled down; the last three reuse the
    # caches of layers 1 (sliding) and 2 (global).
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    num_kv_shared_layers=3,
    sliding_window=16,
    vocab_size_per_layer_input=512,  # at least the tiny tokenizer's vocabulary
    hidden_size_per_layer_input=16,
    altup_num_inputs=2,
    laurel_rank=8,
    _bos=True,
)


class Gemma3nAdapter(TinyDecoderFamily):
    family = "gemma"
    tiny_changes = {"Gemma3nForCausalLM": _GEMMA3N}
    validation_variants = {
        "Gemma3nForCausalLM": [
            # Every layer global: the artifact is croppable; two of four layers reuse layer 1's cache.
            dict(_variant="global-shared2", num_hidden_layers=4, layer_types=[FULL] * 4, num_kv_shared_layers=2),
            # E4B-like: 8 query heads on 1 key-value head, four AltUp copies, activation sparsity in
            # the first layers, 4:1 sliding pattern over 10 layers with the last 5 sharing.
            dict(
                _variant="8q-kv1-altup4-sparse",
                num_hidden_layers=10,
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=8,
                layer_types=([SLIDING] * 4 + [FULL]) * 2,
                num_kv_shared_layers=5,
                altup_num_inputs=4,
                activation_sparsity_pattern=[0.95] * 2 + [0.0] * 8,
            ),
        ],
    }

    def cache_layers(self, cache: Any) -> list[Any]:
        return [layer for _, layer in self.stored_layers(cache)]

    def stored_layers(self, cache: Any) -> list[tuple[int, Any]]:
        return [(index, layer) for index, layer in enumerate(cache.layers) if _owns_cache(layer)]

    def export_cache(self, model: Any, cache: Any) -> tuple[list[LayerEntry], dict[str, torch.Tensor]]:
        layers, tensors = super().export_cache(model, cache)
        owners, readers = sharing(model.config)
        stored = [entry.index for entry in layers]
        if stored != owners:
            raise KvcdnError(
                f"the cache holds layers {stored}, the model's cache-owning layers are {owners}; "
                "no artifact was written"
            )
        shared = [
            entry.with_fields(shared_by=readers[entry.index]) if entry.index in readers else entry for entry in layers
        ]
        return shared, tensors

    def import_cache(
        self, model: Any, layers: Sequence[LayerEntry], tensors: dict[str, torch.Tensor], device: str
    ) -> Any:
        owners, readers = sharing(model.config)
        stored = [entry.index for entry in layers]
        if stored != owners:
            raise ArtifactError(
                f"the artifact stores the caches of layers {stored}, this model's cache-owning layers are {owners}"
            )
        for entry in layers:
            saved, model_readers = entry.family_fields.get("shared_by", []), readers.get(entry.index, [])
            if saved != model_readers:
                raise ArtifactError(
                    f"layer {entry.index} is shared by layers {saved} in the artifact, by {model_readers} in the model"
                )
        return super().import_cache(model, layers, tensors, device)
