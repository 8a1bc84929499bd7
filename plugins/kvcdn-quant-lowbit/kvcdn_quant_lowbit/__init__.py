"""kvcdn quantizers int4 and int2: grouped asymmetric codes packed two or four to a byte.

Each group of ``group_size`` consecutive elements gets a scale and a zero point (the group minimum,
rounded down), so a group's values map onto the codes ``0 .. 2^bits - 1``. Keys are grouped per
channel (consecutive tokens of one channel), values per token (consecutive channels of one token),
which follows how their outliers are distributed. The most recent ``residual`` tokens stay
unquantized: they are the ones the next tokens attend to most.

MLA latents, recurrent states and linear-attention states are too sensitive for 2-4 bits: these
schemes do not declare those layer kinds, so kvcdn keeps such layers in full precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcdn_core import (
    FULL_ATTENTION,
    KEY,
    SLIDING_WINDOW,
    KvcdnError,
    Quantizer,
    hookimpl,
    round_down_param,
    round_up_param,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__version__ = "0.1.0"

#: Slack for float16 rounding of the scale and float32 arithmetic.
_SLACK = 1 + 2e-3
#: Spacing of float16 subnormals: the largest error of rounding a tiny zero point down.
_F16_QUANTUM = 6e-8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2^bits) into bytes, the first code in the low bits; returns 1-D uint8."""
    import torch

    per = 8 // bits
    flat = codes.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    flat = flat.view(-1, per)
    packed = flat[:, 0].clone()
    for j in range(1, per):
        packed |= flat[:, j] << (bits * j)
    return packed


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``count`` codes as uint8."""
    import torch

    per = 8 // bits
    mask = (1 << bits) - 1
    if packed.numel() * per < count:
        raise ValueError(f"{packed.numel()} packed bytes hold fewer than {count} codes")
    columns = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(columns, dim=1).reshape(-1)[:count]


class GroupedQuantizer(Quantizer):
    """Asymmetric quantization in groups along the token axis (keys) or the channel axis (values)."""

    bits = 4
    supported_kinds = (FULL_ATTENTION, SLIDING_WINDOW)
    storage_dtype = "U8"

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @staticmethod
    def _axis(role: str) -> int:
        return -2 if role == KEY else -1

    def _groups(self, x: torch.Tensor, role: str) -> tuple[torch.Tensor, int]:
        """``x`` with the grouped axis last, padded (edge value) to whole groups: ``[..., n, G]``."""
        import torch

        g = self.params["group_size"]
        moved = x.movedim(self._axis(role), -1)
        length = moved.shape[-1]
        pad = (-length) % g
        if pad:
            moved = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], pad)], dim=-1)
        return moved.reshape(*moved.shape[:-1], -1, g), length

    def encode(self, role: str, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        import torch

        groups, length = self._groups(x, role)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        if not bool(torch.isfinite(hi - lo).all()):
            # a group spanning more than float32 holds (values near +-3.4e38 of both signs) has no
            # float32 scale and zero point that decode it finite
            raise KvcdnError(f"scheme {self.scheme}: a group of the {role} tensor spans more than float32 can hold")
        zero = round_down_param(lo)
        scale = round_up_param((hi - zero.to(torch.float32)) / self.levels)
        s = scale.to(torch.float32).unsqueeze(-1)
        shifted = groups - zero.to(torch.float32).unsqueeze(-1)
        codes = torch.where(s > 0, shifted / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(shifted))
        codes = torch.round(codes).clamp_(0, self.levels).to(torch.uint8)
        codes = codes.reshape(*codes.shape[:-2], -1)[..., :length]
        record = {
            "bits": self.bits,
            "group_size": self.params["group_size"],
            "granularity": "per_channel" if role == KEY else "per_token",
            "grouped_axis": "tokens" if role == KEY else "channels",
        }
        return {"": pack(codes, self.bits), "scale": scale, "zero": zero}, record

    def decode(self, role: str, parts: dict[str, torch.Tensor], record: dict[str, Any]) -> torch.Tensor:
        import torch

        shape = list(record["shape"])
        body = shape[:-2] + [int(record["quantized_tokens"]), shape[-1]]
        axis = self._axis(role)
        moved = list(body)
        moved.append(moved.pop(axis))
        length, g = moved[-1], int(record["group_size"])
        count = 1
        for d in moved:
            count *= d
        codes = unpack(parts[""], int(record["bits"]), count).reshape(moved)
        pad = (-length) % g
        if pad:
            codes = torch.cat([codes, codes.new_zeros(*moved[:-1], pad)], dim=-1)
        codes = codes.reshape(*moved[:-1], -1, g).to(torch.float32)
        values = codes * parts["scale"].to(torch.float32).unsqueeze(-1) + parts["zero"].to(torch.float32).unsqueeze(-1)
        values = values.reshape(*moved[:-1], -1)[..., :length]
        return values.movedim(-1, axis)

    def body_error_bound(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """Half a step of the group: ``(max - min + |min| 2^-10) / (2^bits - 1) / 2``, with slack."""
        import torch

        groups, length = self._groups(x, role)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        magnitude = torch.maximum(lo.abs(), hi.abs())
        step = (hi - lo + lo.abs() * 2.0**-10 + _F16_QUANTUM) / self.levels
        bound = (step / 2 * _SLACK + magnitude * 2.0**-20).unsqueeze(-1).expand_as(groups)
        bound = bound.reshape(*bound.shape[:-2], -1)[..., :length]
        return bound.movedim(-1, self._axis(role))


class Int4Quantizer(GroupedQuantizer):
    scheme = "int4"
    description = "grouped asymmetric int4 (scale + zero per group), 2 codes per byte, residual window"
    bits = 4
    default_params = {"group_size": 64, "residual": 128}


class Int2Quantizer(GroupedQuantizer):
    scheme = "int2"
    description = "grouped asymmetric int2 (scale + zero per group), 4 codes per byte, residual window"
    bits = 2
    default_params = {"group_size": 32, "residual": 128}


@hookimpl
def kvcdn_register_quantizers() -> list[type[Quantizer]]:
    return [Int4Quantizer, Int2Quantizer]
