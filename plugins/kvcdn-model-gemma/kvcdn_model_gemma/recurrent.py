"""RecurrentGemma (``RecurrentGemmaForCausalLM``, Griffin): RG-LRU recurrent blocks and local attention.

The model repeats two recurrent blocks and one sliding-window attention block. transformers 5.24
keeps a recurrent block's state on the module, not in the cache it is given:
``temporal_block.conv1d_state`` (the last ``conv1d_width - 1`` inputs of its causal convolution, in
the compute dtype) and ``temporal_block.rg_lru.recurrent_states`` (the RG-LRU hidden state, float32).
The cache holds an empty linear-attention slot for each of those layers, which is why a prefill
through the cache API showed no state. Two more behaviours would make a naive reuse wrong:

- a model holds one state: a second cache on the same model (the reference prefill next to a
  restored artifact, ``--tree`` branches) reads and overwrites the first one's;
- a multi-token input on a state (chunked prefill, a question after a restored document) restarts the
  convolution from zeros: its prefill branch pads the new inputs instead of prepending the saved
  ones. The RG-LRU scan itself does continue from its state (it resets only at position 0).

:class:`RecurrentGemmaAdapter` makes the cache the owner of the state. Each recurrent block's forward
is wrapped, once per model, to take its state from its slot of the cache it is called with, run, and
put the new state back into that slot (``conv_states[0]``, ``recurrent_states[0]`` of transformers'
``LinearAttentionLayer``). On a multi-token input with a state, :func:`continue_block` runs the block
with the convolution fed the saved inputs first; a block it does not know (a future transformers) is
fed one token at a time through the model's own single-step path instead. The slots are ordinary
linear-attention layers, so core's :class:`~kvcdn_core.LinearAttentionLayers` saves them as
``linear_attention`` (reusable only as the whole prefix), and the attention blocks as
``sliding_window``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcdn_core import LinearAttentionLayers, TinyDecoderFamily, set_linear_token_count

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: TINY_DECODER plus Griffin's own fields: recurrent width, convolution, local-attention window.
_GRIFFIN = dict(
    num_hidden_layers=3,
    block_types=["recurrent", "recurrent", "attention"],
    lru_width=64,
    conv1d_width=4,
    attention_window_size=16,
    logits_soft_cap=30.0,
    _bos=True,
)

#: What :func:`continue_block` reads from a recurrent block.
_BLOCK_PARTS = ("linear_x", "linear_y", "linear_out", "conv_1d", "conv1d_width", "act_fn", "rg_lru")


class RecurrentGemmaAdapter(LinearAttentionLayers, TinyDecoderFamily):
    family = "gemma"
    tiny_changes = {"RecurrentGemmaForCausalLM": _GRIFFIN}
    validation_variants = {
        "RecurrentGemmaForCausalLM": [
            # recurrentgemma-2b's multi-query attention (one key-value head), a wider kernel, a
            # recurrent block after the attention one. (Tied embeddings, as in the real checkpoints,
            # make the random tiny model repeat one token.)
            dict(
                _variant="mqa-4layers",
                num_hidden_layers=4,
                num_key_value_heads=1,
                conv1d_width=6,
                attention_window_size=24,
            ),
        ],
    }

    def forward(self, model: Any, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Run ``input_ids`` on ``cache``; recurrent blocks read and write their state in the cache."""
        import torch

        if own_states(model) or input_ids.shape[1] == 1 or not _has_state(cache):
            return super().forward(model, input_ids, cache)
        pieces = []
        for t in range(input_ids.shape[1]):
            logits, cache = super().forward(model, input_ids[:, t : t + 1], cache)
            pieces.append(logits)
        return torch.cat(pieces, dim=1), cache


def recurrent_blocks(model: Any) -> list[tuple[int, Any]]:
    """``(layer index, temporal block)`` of every recurrent block of ``model``."""
    layers = getattr(getattr(model, "model", model), "layers", [])
    return [(i, layer.temporal_block) for i, layer in enumerate(layers) if hasattr(layer.temporal_block, "rg_lru")]


def own_states(model: Any) -> bool:
    """Wrap each recurrent block of ``model`` (once) so its state lives in the cache it is called with.

    Returns whether multi-token continuation is exact too (:func:`continue_block` knows the blocks);
    when not, the blocks are still wrapped and the adapter feeds such input one token at a time.
    """
    done = getattr(model, "_kvcdn_owned_states", None)
    if done is not None:
        return bool(done)
    blocks = recurrent_blocks(model)
    for index, block in blocks:
        block.forward = _cache_owned_forward(index, block, block.forward)
    owned = all(all(hasattr(b, p) for p in _BLOCK_PARTS) for _, b in blocks)
    model._kvcdn_owned_states = owned
    return owned


def _has_state(cache: Any) -> bool:
    return any(getattr(layer, "has_previous_state", {}).get(0) for layer in cache.layers)


def _cache_owned_forward(index: int, block: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(
        input_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        use_cache: bool = True,
        cache: Any = None,
        **kwargs: Any,
    ) -> Any:
        if cache is None or not use_cache:
            return inner(input_states, position_ids, attention_mask, use_cache=use_cache, cache=cache, **kwargs)
        slot = cache.layers[index]
        continuing = bool(slot.has_previous_state[0])
        # None makes the block start from zeros (its own initialisation); else the saved state.
        block.conv1d_state = slot.conv_states[0] if continuing else None
        block.rg_lru.recurrent_states = slot.recurrent_states[0] if continuing else None
        if continuing and input_states.shape[1] > 1:
            out = continue_block(block, input_states, position_ids)
        else:
            out = inner(input_states, position_ids, attention_mask, use_cache=True, cache=cache, **kwargs)
        _store(slot, block.conv1d_state, block.rg_lru.recurrent_states)
        # The state now holds every token up to the last position; a cache whose first layer is
        # recurrent starts the next forward there (transformers 5.25 and later).
        set_linear_token_count(slot, int(position_ids[0, -1]) + 1)
        block.conv1d_state = block.rg_lru.recurrent_states = None  # the cache holds it now
        return out

    return forward


def _store(slot: Any, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
    if not slot.is_conv_states_initialized[0]:
        slot.lazy_initialization(conv_states=conv_state, conv_kernel_size=int(conv_state.shape[-1]))
        slot.lazy_initialization(recurrent_states=recurrent_state)
    slot.conv_states[0].copy_(conv_state)
    slot.recurrent_states[0].copy_(recurrent_state)
    slot.has_previous_state[0] = True


def continue_block(block: Any, input_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The recurrent block's forward on several new tokens, continuing from the state it holds.

    The same steps as transformers' prefill branch, except that the causal convolution sees the
    saved inputs before the new ones (the prefill branch sees zeros there). Leaves the new state on
    the block, as its own forward does.
    """
    import torch

    seq_len = input_states.shape[1]
    y_branch = block.act_fn(block.linear_y(input_states))
    x_branch = block.linear_x(input_states).transpose(1, 2)
    history = torch.cat((block.conv1d_state, x_branch), dim=-1)
    saved = block.conv1d_width - 1
    x_branch = block.conv_1d(history)[..., saved : saved + seq_len]
    block.conv1d_state = history[..., -saved:]
    x_branch = block.rg_lru(x_branch.transpose(1, 2), position_ids)
    return block.linear_out(x_branch * y_branch), None
