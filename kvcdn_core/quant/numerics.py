"""Numerics that quantization schemes share: parameter rounding that keeps stated error bounds.

This module imports torch lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

F16_MAX = 60000.0
F16_TINY = 6.2e-5  # smallest normal float16 is 6.1e-5
#: the spacing of float32's subnormals: a float32 division or product near 1e-38 is no closer than this
FLOAT32_SUBNORMAL_STEP = 2.0**-149
#: float32's largest finite value
FLOAT32_MAX = 3.4028234663852886e38


def round_up_param(t: torch.Tensor) -> torch.Tensor:
    """Round positive parameters up to float16 when that stays exact enough, else keep float32.

    A scale rounded *up* never lets a code overflow its range, so the stated bounds hold; float16
    parameters keep their cost at 2 bytes, which is what makes the compression ratios.
    """
    import torch

    t = t.to(torch.float32)
    nonzero = t[t > 0]
    if nonzero.numel() and (float(nonzero.max()) > F16_MAX or float(nonzero.min()) < F16_TINY):
        return t
    half = t.to(torch.float16)
    low = half.to(torch.float32) < t
    if bool(low.any()):
        half = torch.where(low, torch.nextafter(half, torch.full_like(half, float("inf"))), half)
    return torch.where(t > 0, half, torch.zeros_like(half))


def scale_to_fit(peak: torch.Tensor, top: float) -> torch.Tensor:
    """The float32 scale that maps ``peak`` onto code ``top``, rounded up so no code is clamped.

    ``peak / top`` in float32 rounds to nearest, which can be below the exact quotient; for a peak
    under about ``top * 2^-150`` it underflows to 0, which would zero the whole row. Stepping such a
    scale up to the next float (compared in float64, where ``scale * top`` is exact) keeps every
    code in range and every nonzero row nonzero, so the bounds hold down to the smallest subnormals.
    At the other end, a scale whose ``top`` multiple passes float32's largest value would decode
    that code to inf: such a scale is stepped back down, and the top code, clamped, then misses
    the peak by less than ``top`` steps of the scale's last bit (far inside every bound).
    """
    import torch

    peak = peak.to(torch.float32)
    scale = peak / top
    short = scale.double() * top < peak.double()
    if bool(short.any()):
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    over = scale.double() * top > FLOAT32_MAX
    if bool(over.any()):
        scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    return scale


def round_down_param(t: torch.Tensor) -> torch.Tensor:
    """Round a (signed) offset down to float16 when its range allows, else keep float32."""
    import torch

    t = t.to(torch.float32)
    if t.numel() and float(t.abs().max()) > F16_MAX:
        return t
    half = t.to(torch.float16)
    too_big = half.to(torch.float32) > t
    if bool(too_big.any()):
        lower = torch.nextafter(half, torch.full_like(half, -float("inf")))
        half = torch.where(too_big, lower, half)
    return half


def safe_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    import torch

    s = scale.to(torch.float32)
    return torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
