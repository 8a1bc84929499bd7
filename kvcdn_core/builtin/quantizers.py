"""Core's quantization schemes: int8-tensor, int8 and fp8, registered through the plugin hook.

- ``int8-tensor``: symmetric int8, one float32 scale per tensor (the baseline other tools use).
- ``int8``: symmetric int8, keys with one scale per channel (reduced over tokens), values with one
  scale per token (reduced over channels). Outlier channels of keys (rotary dimensions, the MLA rope
  key) get their own scale instead of coarsening every other channel.
- ``fp8``: float8 e4m3 codes with one scale per token, for keys and values.

Scales are rounded *up* to float16 (float32 when float16 cannot hold them), so no code overflows and
the error bounds in :meth:`body_error_bound` hold exactly. This module imports torch lazily.
"""

from __future__ import annotations

from kvcdn_core import artifact, hookimpl
from kvcdn_core.contracts.quantizer import KEY, Quantizer
from kvcdn_core.quant.numerics import FLOAT32_SUBNORMAL_STEP, round_up_param, scale_to_fit

INT8_MAX = 127
FP8_MAX = 448.0
#: Slack for float16 rounding of scales (up to 2^-10 + 2^-11) and float32 arithmetic.
SCALE_SLACK = 1 + 2e-3


def _divide(x, scale):
    import torch

    s = scale.to(torch.float32)
    return torch.where(s > 0, x / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(x))


class Int8TensorQuantizer(Quantizer):
    scheme = "int8-tensor"
    description = "symmetric int8, one scale per K or V tensor (baseline)"
    supported_kinds = (artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW, artifact.MLA_LATENT)
    storage_dtype = "I8"

    def encode(self, role, x):
        import torch

        scale = scale_to_fit(x.abs().max(), INT8_MAX).reshape(1)
        codes = torch.round(_divide(x, scale)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return {"": codes, "scale": scale}, {}

    def decode(self, role, parts, record):
        import torch

        return parts[""].to(torch.float32) * parts["scale"].to(torch.float32)

    def body_error_bound(self, role, x):
        return (x.abs().max() / (2 * INT8_MAX) * SCALE_SLACK + FLOAT32_SUBNORMAL_STEP).reshape([1] * x.dim())


class Int8Quantizer(Quantizer):
    scheme = "int8"
    description = "symmetric int8, per-channel scales for keys, per-token scales for values"
    supported_kinds = (artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW, artifact.MLA_LATENT)
    storage_dtype = "I8"
    output_suffix = "q8"

    @staticmethod
    def _axis(role):
        return -2 if role == KEY else -1  # keys: per channel (over tokens); values: per token

    def encode(self, role, x):
        import torch

        scale = round_up_param(scale_to_fit(x.abs().amax(dim=self._axis(role), keepdim=True), INT8_MAX))
        codes = torch.round(_divide(x, scale)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return {"": codes, "scale": scale}, {"granularity": "per_channel" if role == KEY else "per_token"}

    def decode(self, role, parts, record):
        import torch

        return parts[""].to(torch.float32) * parts["scale"].to(torch.float32)

    def body_error_bound(self, role, x):
        return x.abs().amax(dim=self._axis(role), keepdim=True) / (2 * INT8_MAX) * SCALE_SLACK + FLOAT32_SUBNORMAL_STEP


class Fp8Quantizer(Quantizer):
    scheme = "fp8"
    description = "float8 e4m3 codes with per-token scales"
    supported_kinds = (artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW)
    storage_dtype = "F8_E4M3"

    def encode(self, role, x):
        import torch

        scale = round_up_param(scale_to_fit(x.abs().amax(dim=-1, keepdim=True), FP8_MAX))
        codes = _divide(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"": codes, "scale": scale}, {"granularity": "per_token", "format": "e4m3fn"}

    def decode(self, role, parts, record):
        import torch

        return parts[""].to(torch.float32) * parts["scale"].to(torch.float32)

    def body_error_bound(self, role, x):
        """e4m3 keeps 3 mantissa bits: relative error 2^-4 on normals, 2^-10 of the scale on subnormals.

        Plus float32's own subnormal spacing (2^-149): decoding ``q * scale`` in float32 cannot be
        closer than that when the scale itself underflows (rows of values near 1e-38).
        """
        import torch

        scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX * SCALE_SLACK
        return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * SCALE_SLACK + FLOAT32_SUBNORMAL_STEP


@hookimpl
def kvcdn_register_quantizers():
    return [Int8TensorQuantizer, Int8Quantizer, Fp8Quantizer]
