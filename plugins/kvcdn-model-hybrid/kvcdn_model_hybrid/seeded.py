"""Mamba mixers of hybrids that drop the cached state on multi-token input: Jamba and Zamba.

transformers 5.24 runs their multi-token path through a selective scan that starts from a zero
state, as Mamba's does (see :mod:`kvcdn_model_ssm.scan`): a prefill chunk after the first, and a
multi-token question on a restored artifact, forget the prefix in those layers (the attention layers
still see it, so the output drifts rather than breaks). kvcdn seeds the scan with the cached state:
Jamba's mixer is FalconMamba's computation (same projections and B/C/Δ norms) and takes
:func:`kvcdn_model_ssm.scan.continue_mixer` as is; Zamba's splits the channels into heads with their
own projections, which :func:`continue_zamba_mixer` follows. A mixer lacking what these read is fed
one token at a time through the model's single-step path instead. Mamba2 mixers (Bamba, Zamba2,
Falcon-H1, Granite 4 hybrid) take the state themselves and are not touched.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from kvcdn_model_ssm import scan

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: Zamba mixer attributes :func:`continue_zamba_mixer` reads: Mamba's, with per-head x/Δ weights.
ZAMBA_ATTRIBUTES = (
    *(a for a in scan.MIXER_ATTRIBUTES if a not in ("x_proj", "dt_proj")),
    "x_proj_weight",
    "dt_proj_weight",
    "dt_proj_bias",
    "n_mamba_heads",
    "mamba_head_dim",
)


def supports_zamba(mixer: Any) -> bool:
    """Whether :func:`continue_zamba_mixer` computes what this mixer would."""
    return scan.supports(mixer, ZAMBA_ATTRIBUTES)


def continue_zamba_mixer(mixer: Any, hidden_states: torch.Tensor, cache: Any) -> torch.Tensor:
    """Zamba's mixer output for ``hidden_states`` [B, T, H] after the state cached for its layer.

    Each Mamba head scans its share of the channels with its own x/dt projections, from its part of
    the cached state [B, heads, head_dim, S]; the cache's conv and recurrent states are updated as
    the mixer would.
    """
    import torch
    import torch.nn.functional as F

    module = sys.modules[type(mixer).__module__]
    batch, seq_len, _ = hidden_states.shape
    dtype, idx = hidden_states.dtype, mixer.layer_idx
    heads, head_dim = mixer.n_mamba_heads, mixer.mamba_head_dim
    state = cache.get_recurrent_state(idx, state_idx=0)

    projected = mixer.in_proj(hidden_states).transpose(1, 2)
    x, gate = projected.view(batch, -1, 2, seq_len).chunk(2, dim=2)  # channels interleave x and gate
    x = x.squeeze(2).contiguous()
    gate = gate.reshape(batch, heads, head_dim, seq_len).transpose(0, 1)
    x = cache.update_conv_state(x, idx, conv_kernel_size=mixer.conv_kernel_size)
    x = module.causal_conv1d_fn(x, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation=mixer.activation)[
        :, :, -seq_len:
    ]
    x = x.reshape(batch, heads, head_dim, seq_len).transpose(0, 1)  # [heads, B, head_dim, T]

    params = (mixer.x_proj_weight[:, None] @ x).transpose(-1, -2)
    time_step, B, C = torch.split(params, [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    time_step = mixer.dt_proj_weight[:, None] @ time_step.transpose(-1, -2)
    A = -torch.exp(mixer.A_log.float())
    outputs, last_states = [], []
    for h in range(heads):
        dt = F.softplus(time_step[h] + mixer.dt_proj_bias[h].float().to(time_step.dtype)[..., None])
        y, last = scan.selective_scan(x[h], dt, A[h], B[h], C[h], None if state is None else state[:, h], dtype)
        outputs.append((y + x[h] * mixer.D[h].float()[None, :, None]) * F.silu(gate[h]))
        last_states.append(last)
    cache.update_recurrent_state(torch.stack(last_states, dim=1), idx)
    output: torch.Tensor = mixer.out_proj(torch.cat(outputs, dim=1).transpose(1, 2).to(dtype))
    return output


#: ``config.model_type`` → (mixer class names, continuation, support check) for the hybrids whose
#: multi-token Mamba path drops the cached state (transformers 5.24).
STATE_DROPPING = {
    "jamba": (("JambaMambaMixer",), scan.continue_mixer, scan.supports),
    "zamba": (("ZambaMambaMixer",), continue_zamba_mixer, supports_zamba),
}


def holds_state(cache: Any) -> bool:
    """Whether some linear-attention layer of ``cache`` already holds a state."""
    return any(any(getattr(layer, "has_previous_state", {}).values()) for layer in cache.layers)


def continue_forward(
    forward: scan.Forward, model: Any, input_ids: torch.Tensor, cache: Any
) -> tuple[torch.Tensor, Any]:
    """``forward(model, input_ids, cache)``, continuing every Mamba layer from its cached state."""
    spec = STATE_DROPPING.get(model.config.model_type)
    if spec is None or input_ids.shape[1] == 1 or not holds_state(cache) or scan.seed_mixers(model, *spec):
        return forward(model, input_ids, cache)
    return scan.step_by_step(forward, model, input_ids, cache)
