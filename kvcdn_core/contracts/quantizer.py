"""The quantizer contract: one scheme that turns a cache tensor into stored parts and back.

A quantizer turns one cache tensor into a few stored tensors (codes, scales, zero points, a residual
window) plus a JSON record, and back. Tensors are laid out ``[..., tokens, channels]`` (transformers
caches are ``[batch, heads, tokens, head_dim]``): "per channel" reduces over the token axis (-2),
"per token" over the channel axis (-1). Tensors whose layer-local name starts with ``value`` are
values; every other tensor (keys, MLA latents, rotary keys) is treated like a key.
``kvcdn_core.testing.assert_quantizer_contract`` checks a scheme against this contract. This module
imports torch lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from kvcdn_core import artifact
from kvcdn_core.errors import ArtifactError, KvcdnError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: Stored tensors of one quantized tensor: ``""`` the codes, other names ``<tensor>.<name>``.
Parts = dict[str, "torch.Tensor"]
#: The JSON record of one quantized tensor (kept in the manifest's quantization block).
Record = dict[str, Any]

#: Version of the ``quantization`` manifest block; readers refuse a newer one.
QUANT_BLOCK_VERSION = 1

#: Target dtypes (what an artifact dequantizes to on load): safetensors name → torch dtype name.
TARGET_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: Storage dtypes a user may name instead of a scheme: dtype → the scheme that stores it.
STORAGE_DTYPE_SCHEMES = {"I8": "int8", "FP8": "fp8"}
#: Other spellings of dtype names → the canonical one.
DTYPE_ALIASES = {
    "FLOAT32": "F32",
    "FP32": "F32",
    "FLOAT16": "F16",
    "FP16": "F16",
    "HALF": "F16",
    "BFLOAT16": "BF16",
    "INT8": "I8",
    "F8": "FP8",
    "F8_E4M3": "FP8",
    "FLOAT8": "FP8",
    "E4M3": "FP8",
}
#: Requests we refuse as a target dtype, with why and what to use instead.
REFUSED_TARGETS = {
    "U8": "unsigned 8-bit cannot hold keys and values, which are signed, without a zero point; "
    "use --dtype I8 (symmetric int8) or --scheme int4/int2 (asymmetric, with zero points)",
    "I4": "4-bit integers are a storage format, not a dtype a model computes in; "
    "use --scheme int4 (it dequantizes to F32/F16/BF16 on load)",
    "U4": "4-bit integers are a storage format, not a dtype a model computes in; "
    "use --scheme int4 (asymmetric, scale and zero point per group)",
    "FP4": "no kvcdn scheme stores 4-bit floats: with one mantissa bit they lose too much of a KV "
    "cache; use --scheme int4, whose per-group scale and zero point keep more precision",
    "FP1": "there is no 1-bit float format: one bit cannot encode sign, exponent and mantissa; "
    "the smallest kvcdn scheme is --scheme int2",
    "I2": "2-bit integers are a storage format, not a dtype a model computes in; use --scheme int2",
    "F64": "float64 is wider than any compute dtype kvcdn uses; use F32",
}

#: Names core writes into every quantized tensor's record, beside the scheme's own (and reads back
#: on load): a scheme's ``encode`` record must not use them, or the manifest would lie to the loader.
RESERVED_RECORD_KEYS = frozenset(
    {"name", "action", "parts", "shape", "dtype", "role", "quantized_tokens", "residual_tokens", "empty", "reason"}
)

#: The two tensor roles: values are quantized per token, everything else like keys.
KEY, VALUE = "key", "value"


def role_of(local_name: str) -> str:
    """``value`` for value tensors (quantized per token), ``key`` for every other tensor."""
    return VALUE if local_name.startswith("value") else KEY


def _st_name(torch_dtype: Any) -> str:
    return artifact.TORCH_TO_ST[str(torch_dtype).removeprefix("torch.")]


class Quantizer:
    """One quantization scheme. Subclasses set the class attributes and implement :meth:`encode`
    and :meth:`decode`; the base class handles parameters, the residual window and layer kinds.

    ``encode(role, x)`` gets a float32 tensor laid out ``[..., tokens, channels]`` and returns the
    stored parts (``""`` for the codes, other keys become ``<name>.<key>`` tensors) and a JSON record;
    ``decode(role, parts, record)`` returns the float32 approximation of ``x``.

    On load, :meth:`dequantize` (hence ``decode``) runs layer by layer as each layer's bytes are
    read and verified, on the loader's worker threads while the model runs on earlier layers: it
    must be a pure function of its arguments (safe to call from several threads at once) and must
    not modify ``parts`` in place (they are views on the read buffer).
    """

    #: The ``--scheme`` name; unique across installed plugins.
    scheme: ClassVar[str] = ""
    #: One line for ``kvcdn quant --help`` and the docs.
    description: ClassVar[str] = ""
    #: Layer kinds this scheme quantizes; layers of other kinds are kept in full precision.
    supported_kinds: ClassVar[tuple[str, ...]] = (artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW)
    #: safetensors dtype of the codes (``U8`` for packed sub-byte codes).
    storage_dtype: ClassVar[str] = "I8"
    #: Parameter name → default; ``residual`` (most recent tokens kept unquantized) is handled here.
    default_params: ClassVar[dict[str, int]] = {}
    #: The default output suffix, ``<stem>.<suffix>.kv``; the scheme name when empty.
    output_suffix: ClassVar[str] = ""

    def __init__(self, **params: int | None) -> None:
        unknown = sorted(set(params) - set(self.default_params))
        if unknown:
            accepted = ", ".join(sorted(self.default_params)) or "none"
            raise KvcdnError(f"scheme {self.scheme} takes no parameter {', '.join(unknown)} (it takes: {accepted})")
        self.params = {**self.default_params, **{k: v for k, v in params.items() if v is not None}}
        for name, value in self.params.items():
            if not isinstance(value, int) or value < 0 or (name == "group_size" and value < 1):
                raise KvcdnError(
                    f"scheme {self.scheme}: {name} must be a "
                    f"{'positive' if name == 'group_size' else 'non-negative'} integer, got {value!r}"
                )

    @property
    def residual(self) -> int:
        return int(self.params.get("residual", 0))

    def supports(self, kind: str) -> bool:
        return kind in self.supported_kinds

    # -- one tensor ------------------------------------------------------------------------

    def quantize(self, role: str, tensor: torch.Tensor) -> tuple[Parts, Record]:
        """Quantize one tensor: ``(parts, record)``; the most recent ``residual`` tokens stay as they are."""
        import torch

        if tensor.dim() < 2:
            raise ValueError("quantizable tensors have a token and a channel axis")
        tokens = tensor.shape[-2]
        keep = min(self.residual, tokens)
        body = tensor.narrow(-2, 0, tokens - keep).to(torch.float32)
        if body.numel() and not bool(torch.isfinite(body).all()):
            # no scale keeps a bound on inf or NaN: the codes would be garbage, silently
            raise KvcdnError(f"scheme {self.scheme}: the {role} tensor holds inf or NaN values; it cannot be quantized")
        parts: Parts
        record: Record
        parts, record = ({}, {}) if body.numel() == 0 else self.encode(role, body.contiguous())
        clash = sorted(RESERVED_RECORD_KEYS.intersection(record))
        if clash:
            raise KvcdnError(
                f"scheme {self.scheme}: its record uses {', '.join(clash)}, which core reserves "
                f"(reserved record keys: {', '.join(sorted(RESERVED_RECORD_KEYS))}); rename them in encode()"
            )
        record = {
            "shape": list(tensor.shape),
            "dtype": _st_name(tensor.dtype),
            "role": role,
            "quantized_tokens": tokens - keep,
            "residual_tokens": keep,
            **record,
        }
        if body.numel() == 0:
            parts = {"": torch.empty(0, dtype=torch.uint8)}
            record["empty"] = True
        if keep:
            parts["residual"] = tensor.narrow(-2, tokens - keep, keep).contiguous()
        return parts, record

    def dequantize(self, parts: Parts, record: Record, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor :meth:`quantize` was given, approximately, in ``dtype`` (default: its own)."""
        import torch

        shape = list(record["shape"])
        dtype = dtype or getattr(torch, artifact.DTYPES[record["dtype"]][1])
        pieces = []
        if record["quantized_tokens"] and record.get("empty"):  # a zero-width tensor: nothing was encoded
            pieces.append(torch.zeros(shape[:-2] + [record["quantized_tokens"], shape[-1]], dtype=dtype))
        elif record["quantized_tokens"]:
            body = self.decode(record["role"], parts, record)
            want = shape[:-2] + [record["quantized_tokens"], shape[-1]]
            if list(body.shape) != want:
                raise ArtifactError(f"scheme {self.scheme} decoded shape {list(body.shape)}, expected {want}")
            pieces.append(body.to(dtype))
        if record["residual_tokens"]:
            pieces.append(parts["residual"].to(dtype))
        if not pieces:
            return torch.empty(shape, dtype=dtype, device=parts[""].device)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)

    # -- implemented by schemes -------------------------------------------------------------

    def encode(self, role: str, x: torch.Tensor) -> tuple[Parts, Record]:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, role: str, parts: Parts, record: Record) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def body_error_bound(self, role: str, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Elementwise bound on the error of :meth:`encode` + :meth:`decode` on ``x`` (float32)."""
        raise NotImplementedError

    def error_bound(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on ``|x - dequantize(quantize(x))|`` this scheme guarantees: the
        scheme's bound on the quantized tokens, zero on the residual window (kept bitwise)."""
        import torch

        tokens = tensor.shape[-2]
        keep = min(self.residual, tokens)
        body = tensor.narrow(-2, 0, tokens - keep).to(torch.float32)
        bound = self.body_error_bound(role, body) if body.numel() else body
        zeros = torch.zeros_like(tensor.narrow(-2, tokens - keep, keep), dtype=torch.float32)
        return torch.cat([bound.expand_as(body), zeros], dim=-2)

    @classmethod
    def default_output_suffix(cls) -> str:
        return cls.output_suffix or cls.scheme
