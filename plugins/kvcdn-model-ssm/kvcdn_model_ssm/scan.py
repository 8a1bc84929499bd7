"""A multi-token Mamba / FalconMamba mixer step that starts from the cached state.

transformers 5.24 runs a multi-token input through a selective scan that always starts from a zero
state (its CUDA kernel has no initial-state input, and the torch fallback mirrors it), so chunked
prefill and a multi-token question on a restored cache silently lose the prefix. Feeding tokens one
at a time is exact but reads every weight once per token (8x slower on a 130M model here).
:func:`continue_mixer` is the same computation as the mixer's torch path with the scan seeded by the
cached state, so a continuation stays one batched call. It uses the mixer's own submodules and its
module's convolution function; the tests hold it to a full prefill of the same tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: ``forward(model, input_ids, cache) -> (logits, cache)``: an adapter's forward.
Forward = Callable[[Any, "torch.Tensor", Any], "tuple[torch.Tensor, Any]"]
#: ``continue_fn(mixer, hidden_states, cache) -> output``: a mixer's continuation from its state.
Continuation = Callable[[Any, "torch.Tensor", Any], "torch.Tensor"]

#: Mixer attributes :func:`continue_mixer` reads; a transformers version without them falls back to
#: token-by-token feeding (see ``SSMAdapter.forward``).
MIXER_ATTRIBUTES = (
    "in_proj",
    "conv1d",
    "x_proj",
    "dt_proj",
    "out_proj",
    "A_log",
    "D",
    "activation",
    "conv_kernel_size",
    "time_step_rank",
    "ssm_state_size",
    "layer_idx",
)
#: FalconMamba normalises time step, B and C before the scan.
FALCON_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def supports(mixer: Any, attributes: Sequence[str] = MIXER_ATTRIBUTES) -> bool:
    """Whether a continuation reading ``attributes`` (by default :func:`continue_mixer`'s) computes
    what this mixer would (weights used as plain tensors)."""
    module = sys.modules.get(type(mixer).__module__)
    if hasattr(getattr(mixer, "config", None), "_is_quantized"):
        return False  # quantized linears: their .weight is not the matrix the mixer multiplies by
    return all(hasattr(mixer, a) for a in attributes) and hasattr(module, "causal_conv1d_fn")


def continue_mixer(mixer: Any, hidden_states: torch.Tensor, cache: Any) -> torch.Tensor:
    """The mixer's output for ``hidden_states`` [B, T, H] after the state cached for its layer.

    Updates the layer's conv and recurrent state in ``cache`` as the mixer would.
    """
    import torch
    import torch.nn.functional as F

    module = sys.modules[type(mixer).__module__]
    seq_len, dtype, idx = hidden_states.shape[1], hidden_states.dtype, mixer.layer_idx
    state = cache.get_recurrent_state(idx, state_idx=0)

    projected = mixer.in_proj(hidden_states).transpose(1, 2)
    x, gate = projected.chunk(2, dim=1)
    # The cache returns its last conv inputs followed by the new ones: the causal convolution sees
    # the real left context, and only the new positions are kept.
    x = cache.update_conv_state(x, idx, conv_kernel_size=mixer.conv_kernel_size)
    x = module.causal_conv1d_fn(x, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation=mixer.activation)[
        :, :, -seq_len:
    ]

    x = x.transpose(1, 2)
    time_step, B, C = torch.split(
        mixer.x_proj(x), [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1
    )
    if all(hasattr(mixer, n) for n in FALCON_NORMS):
        time_step, B, C = mixer.dt_layernorm(time_step), mixer.b_layernorm(B), mixer.c_layernorm(C)
    # Dtypes follow the torch scan step by step (bias and softplus in the compute dtype, the state
    # and D in float32): under bfloat16 any other rounding shows up within a few decoded tokens.
    dt = mixer.dt_proj.weight @ time_step.transpose(1, 2)
    if mixer.dt_proj.bias is not None:
        dt = dt + mixer.dt_proj.bias.float().to(dt.dtype)[..., None]
    dt = F.softplus(dt)

    x = x.transpose(1, 2)  # [B, I, T]
    y, h = selective_scan(x, dt, -torch.exp(mixer.A_log.float()), B, C, state, dtype)
    y = (y + x * mixer.D.float()[None, :, None]) * F.silu(gate)
    cache.update_recurrent_state(h, idx)
    output: torch.Tensor = mixer.out_proj(y.transpose(1, 2).to(dtype))
    return output


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' torch selective scan, started from ``state`` instead of zeros.

    ``x`` and ``dt`` (time step after bias and softplus) are [b, I, T], ``A`` [I, S], ``B`` and ``C``
    [b, T, S], ``state`` [b, I, S] or None. Returns the scan output [b, I, T] (before the D skip and
    the gate) and the last state, in float32 as the model keeps it.
    """
    import torch

    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    inject = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    h = state.float() if state is not None else torch.zeros_like(inject[:, :, 0])
    outputs = []
    for t in range(x.shape[-1]):
        h = decay[:, :, t] * h + inject[:, :, t]
        outputs.append(torch.matmul(h.to(dtype), C[:, t, :].unsqueeze(-1))[:, :, 0])
    return torch.stack(outputs, dim=-1), h


def seed_mixers(model: Any, classes: Sequence[str], continue_fn: Continuation, supports: Callable[[Any], bool]) -> bool:
    """Wrap the ``forward`` of every mixer of ``model`` whose class is named in ``classes``, once per
    model, so that multi-token input on a cached state runs ``continue_fn(mixer, hidden, cache)``.

    Returns False (and changes nothing) when a mixer fails ``supports(mixer)``; the caller then feeds
    tokens one at a time (:func:`step_by_step`).
    """
    done = getattr(model, "_kvcdn_seeded_mixers", None)
    if done is not None:
        return bool(done)
    mixers = [m for m in model.modules() if type(m).__name__ in classes]
    ok = bool(mixers) and all(supports(m) for m in mixers)
    if ok:
        for mixer in mixers:
            mixer.forward = _seeded_forward(mixer, mixer.forward, continue_fn)
    model._kvcdn_seeded_mixers = ok
    return ok


def _seeded_forward(mixer: Any, inner: Callable[..., Any], continue_fn: Continuation) -> Callable[..., Any]:
    def forward(
        hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        idx = mixer.layer_idx
        if (
            cache is not None
            and attention_mask is None
            and hidden_states.shape[1] > 1
            and cache.has_previous_state(idx)
            and not cache.is_recording_past(idx)
        ):
            return continue_fn(mixer, hidden_states, cache)
        return inner(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)

    return forward


def step_by_step(forward: Forward, model: Any, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """``forward(model, input_ids, cache)`` one token at a time, through the model's single-step path
    (which continues from the cached state): exact, slower on long inputs."""
    import torch

    pieces = []
    for t in range(input_ids.shape[1]):
        logits, cache = forward(model, input_ids[:, t : t + 1], cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache
