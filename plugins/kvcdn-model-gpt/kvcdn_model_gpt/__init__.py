"""kvcdn model family: GPT-2, GPT-Neo, GPT-J, GPT-NeoX, GPTBigCode, Bloom and Falcon.

All of them keep a plain transformers ``DynamicCache`` of full-attention layers, whatever their
position encoding (learned absolute positions, rotary, ALiBi) or key/value head layout (multi-head,
multi-query, grouped), so the base adapter exports and imports them. What this plugin adds:

- a refusal, before any work, for configs whose cache is not a plain decoder cache (GPT-2 and
  GPTBigCode with ``add_cross_attention`` use an encoder-decoder cache), and for any cache that is
  not a ``DynamicCache``;
- a refusal, instead of an index error deep in the model, for a sequence longer than the learned
  absolute position table of GPT-2, GPT-Neo and GPTBigCode;
- the key/value head count and position encoding in each layer's manifest entry, so an artifact says
  what its tensors are (a multi-query layer holds one key head for all query heads; an ALiBi layer's
  keys carry no position at all). GPT-Neo's local layers mask attention to a window but cache every
  token, so they are full-attention caches; their entry adds ``attention_window``;
- for Falcon's new decoder architecture (Falcon-40B/180B), the artifact keeps one key/value head per
  group, with ``repeated_heads`` (query heads per group) in the layer entry. transformers up to 5.24
  caches a copy of each head for every query head of its group: the export keeps one of the copies
  and the import repeats it, so the artifact is ``num_attention_heads / num_kv_heads`` smaller (16x
  for Falcon-40B) and the rebuilt cache is bitwise the one transformers made. From 5.25 transformers
  caches one head per group itself and the import leaves the heads as stored; the same artifact loads
  under either release.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcdn_core import ArtifactError, KvcdnError, LayerEntry, ModelAdapter, hookimpl

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__version__ = "0.1.0"

#: model_type → config attribute naming the size of a learned absolute position table.
LEARNED_POSITIONS = {"gpt2": "n_positions", "gpt_bigcode": "n_positions", "gpt_neo": "max_position_embeddings"}


def position_encoding(config: Any) -> str:
    """How the model encodes positions: ``learned`` (absolute table), ``rotary`` or ``alibi``."""
    model_type = config.model_type
    if model_type in LEARNED_POSITIONS:
        return "learned"
    if model_type == "bloom" or (model_type == "falcon" and getattr(config, "alibi", False)):
        return "alibi"
    return "rotary"


class GptAdapter(ModelAdapter):
    family = "gpt"
    architectures = (
        "GPT2LMHeadModel",
        "GPTNeoForCausalLM",
        "GPTJForCausalLM",
        "GPTNeoXForCausalLM",
        "GPTBigCodeForCausalLM",
        "BloomForCausalLM",
        "FalconForCausalLM",
    )
    validation_configs = {
        "GPT2LMHeadModel": dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512),
        # Local layers (window 32) alternate with global ones, as in GPT-Neo 125M-2.7B.
        "GPTNeoForCausalLM": dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=128,
            window_size=32,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=512,
        ),
        "GPTJForCausalLM": dict(
            n_embd=64, n_layer=2, n_head=4, n_inner=128, rotary_dim=8, n_positions=2048, tie_word_embeddings=False
        ),
        "GPTNeoXForCausalLM": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.25,
            max_position_embeddings=2048,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
        # StarCoder / SantaCoder layout: one key/value head shared by every query head.
        "GPTBigCodeForCausalLM": dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512, multi_query=True),
        "BloomForCausalLM": dict(hidden_size=64, n_layer=2, n_head=4),
        # Falcon-40B/180B layout: new decoder architecture with grouped key/value heads.
        "FalconForCausalLM": dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
            alibi=False,
        ),
    }

    def load(self, model_dir: Path, device: str, dtype: str) -> tuple[Any, Any]:
        model, tokenizer = super().load(model_dir, device, dtype)
        config = model.config
        if getattr(config, "add_cross_attention", False):
            raise KvcdnError(
                f"{config.architectures[0] if config.architectures else config.model_type} with "
                "add_cross_attention keeps an encoder-decoder cache; kvcdn artifacts hold decoder-only "
                "caches, so this model is not supported"
            )
        return model, tokenizer

    def forward(self, model: Any, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        attr = LEARNED_POSITIONS.get(model.config.model_type)
        if attr is not None:
            limit = int(getattr(model.config, attr))
            total = int(cache.get_seq_length()) + int(input_ids.shape[-1])
            if total > limit:
                raise KvcdnError(
                    f"{total} tokens exceed the {limit} learned positions of this "
                    f"{model.config.model_type} model ({attr}); use a shorter context"
                )
        return super().forward(model, input_ids, cache)

    def cache_layers(self, cache: Any) -> list[Any]:
        from transformers import DynamicCache

        if not isinstance(cache, DynamicCache):
            raise KvcdnError(
                f"the model returned a {type(cache).__name__}, not a decoder DynamicCache; no artifact was written"
            )
        return super().cache_layers(cache)

    def export_cache(self, model: Any, cache: Any) -> tuple[list[LayerEntry], dict[str, torch.Tensor]]:
        layers, tensors = super().export_cache(model, cache)
        encoding = position_encoding(model.config)
        groups = falcon_kv_groups(model.config)
        typed = []
        for entry in layers:
            fields: dict[str, Any] = {}
            if groups:
                names = list(entry.tensors.values())
                collapsed = [collapse_heads(tensors[name], groups) for name in names]
                if all(t.shape[1] == groups for t in collapsed):  # both or neither
                    tensors.update(zip(names, collapsed))
                    fields["repeated_heads"] = int(model.config.num_attention_heads) // groups
            fields["kv_heads"] = int(tensors[entry.tensors["key"]].shape[1])
            fields["position_encoding"] = encoding
            if local_attention(model.config, entry.index):
                fields["attention_window"] = int(model.config.window_size)
            typed.append(entry.with_fields(**fields))
        return typed, tensors

    def import_cache(
        self, model: Any, layers: Sequence[LayerEntry], tensors: dict[str, torch.Tensor], device: str
    ) -> Any:
        tensors = dict(tensors)
        heads = int(model.config.num_attention_heads)
        repeats_heads = caches_every_query_head()
        for entry in layers:
            repeat = int(entry.family_fields.get("repeated_heads", 1))
            if repeat == 1 or not repeats_heads:
                continue
            for name in entry.tensors.values():
                t = tensors[name]
                if t.shape[1] * repeat != heads:
                    raise ArtifactError(
                        f"layer {entry.index} stores {t.shape[1]} key/value heads repeated {repeat} "
                        f"times, the loaded model has {heads} attention heads"
                    )
                tensors[name] = t.repeat_interleave(repeat, dim=1)
        return super().import_cache(model, layers, tensors, device)


def local_attention(config: Any, index: int) -> bool:
    """GPT-Neo's ``local`` layers: attention masked to ``window_size`` tokens, cache kept whole."""
    layers = getattr(config, "attention_layers", None) if config.model_type == "gpt_neo" else None
    return layers is not None and bool(layers) and layers[index] == "local"


def _bit_views() -> dict[int, torch.dtype]:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def falcon_kv_groups(config: Any) -> int | None:
    """Falcon's new decoder architecture caches every query head, though only ``num_kv_heads``
    distinct key/value heads exist (transformers broadcasts each group before caching)."""
    if config.model_type != "falcon" or not getattr(config, "new_decoder_architecture", False):
        return None
    groups = int(config.num_kv_heads)
    return groups if groups < int(config.num_attention_heads) else None


def caches_every_query_head() -> bool:
    """Whether this transformers' Falcon caches a copy of each key/value head for every query head of
    its group: up to 5.24 it broadcast the heads before caching; from 5.25 it repeats them inside
    attention and caches each group's one head."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return (major, minor) < (5, 25)


def collapse_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Keep one head per group when every head of the group is an exact copy; else ``t`` unchanged.

    Exact copies only: the check is bitwise, so a cache that does not repeat its heads is stored as is.
    """
    heads = t.shape[1]
    if heads == groups or heads % groups:
        return t
    grouped = t.reshape(t.shape[0], groups, heads // groups, *t.shape[2:])
    first = grouped[:, :, :1]
    bits = _bit_views()[t.element_size()]
    if not bool((grouped.view(bits) == first.view(bits)).all()):
        return t
    return first.squeeze(2).contiguous()


@hookimpl
def kvcdn_register_model_adapters() -> list[type[GptAdapter]]:
    return [GptAdapter]
