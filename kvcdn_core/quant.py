"""Quantized artifacts: the :class:`Quantizer` contract, quantizing an artifact, dequantizing on load.

A quantizer turns one cache tensor into a few stored tensors (codes, scales, zero points, a residual
window) plus a JSON record, and back. Quantizers are plugins (entry-point group ``kvcdn.quantizers``,
hook ``kvcdn_register_quantizers``); core's int8 and fp8 schemes register the same way.

Storage rule (see docs/quantization.md): a quantized tensor keeps its name for its codes (so the
manifest's layer entries still name tensors the file holds) and adds ``<name>.<part>`` tensors for
the rest. Layers of a kind the scheme does not support keep their tensors unchanged. The manifest's
``quantization`` block records the scheme, its parameters, the target and storage dtypes and what was
done to every layer, so :func:`dequantize_tensors` can rebuild the exact tensor names and shapes an
unquantized artifact has: everything that loads an artifact dequantizes transparently.

Tensors are laid out ``[..., tokens, channels]`` (transformers caches are ``[batch, heads, tokens,
head_dim]``): "per channel" reduces over the token axis (-2), "per token" over the channel axis (-1).
Tensors whose layer-local name starts with ``value`` are values; every other tensor (keys, MLA latents,
rotary keys) is treated like a key. This module imports torch lazily.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
from typing import Any, ClassVar

from kvcdn_core import artifact as fmt
from kvcdn_core.errors import ArtifactError, KvcdnError

#: Version of the ``quantization`` manifest block; readers refuse a newer one.
QUANT_BLOCK_VERSION = 1

#: Target dtypes (what an artifact dequantizes to on load): safetensors name → torch dtype name.
TARGET_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: Storage dtypes a user may name instead of a scheme: dtype → the scheme that stores it.
STORAGE_DTYPE_SCHEMES = {"I8": "int8", "FP8": "fp8"}
_DTYPE_ALIASES = {
    "FLOAT32": "F32", "FP32": "F32", "FLOAT16": "F16", "FP16": "F16", "HALF": "F16",
    "BFLOAT16": "BF16", "INT8": "I8", "F8": "FP8", "F8_E4M3": "FP8", "FLOAT8": "FP8", "E4M3": "FP8",
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

KEY, VALUE = "key", "value"


def role_of(local_name: str) -> str:
    """``value`` for value tensors (quantized per token), ``key`` for every other tensor."""
    return VALUE if local_name.startswith("value") else KEY


def _st_name(torch_dtype) -> str:
    return fmt.TORCH_TO_ST[str(torch_dtype).removeprefix("torch.")]


# -- the contract -----------------------------------------------------------------------------


class Quantizer:
    """One quantization scheme. Subclasses set the class attributes and implement :meth:`encode`
    and :meth:`decode`; the base class handles parameters, the residual window and layer kinds.

    ``encode(role, x)`` gets a float32 tensor laid out ``[..., tokens, channels]`` and returns the
    stored parts (``""`` for the codes, other keys become ``<name>.<key>`` tensors) and a JSON record;
    ``decode(role, parts, record)`` returns the float32 approximation of ``x``.
    """

    #: The ``--scheme`` name; unique across installed plugins.
    scheme: ClassVar[str] = ""
    #: One line for ``kvcdn quant --help`` and the docs.
    description: ClassVar[str] = ""
    #: Layer kinds this scheme quantizes; layers of other kinds are kept in full precision.
    supported_kinds: ClassVar[tuple[str, ...]] = (fmt.FULL_ATTENTION, fmt.SLIDING_WINDOW)
    #: safetensors dtype of the codes (``U8`` for packed sub-byte codes).
    storage_dtype: ClassVar[str] = "I8"
    #: Parameter name → default; ``residual`` (most recent tokens kept unquantized) is handled here.
    default_params: ClassVar[dict[str, int]] = {}
    #: The default output suffix, ``<stem>.<suffix>.kv``; the scheme name when empty.
    output_suffix: ClassVar[str] = ""

    def __init__(self, **params):
        unknown = sorted(set(params) - set(self.default_params))
        if unknown:
            accepted = ", ".join(sorted(self.default_params)) or "none"
            raise KvcdnError(f"scheme {self.scheme} takes no parameter {', '.join(unknown)} (it takes: {accepted})")
        self.params = {**self.default_params, **{k: v for k, v in params.items() if v is not None}}
        for name, value in self.params.items():
            if not isinstance(value, int) or value < 0 or (name == "group_size" and value < 1):
                raise KvcdnError(f"scheme {self.scheme}: {name} must be a "
                                 f"{'positive' if name == 'group_size' else 'non-negative'} integer, got {value!r}")

    @property
    def residual(self) -> int:
        return int(self.params.get("residual", 0))

    def supports(self, kind: str) -> bool:
        return kind in self.supported_kinds

    # -- one tensor ------------------------------------------------------------------------

    def quantize(self, role: str, tensor) -> tuple[dict[str, Any], dict]:
        """Quantize one tensor: ``(parts, record)``; the most recent ``residual`` tokens stay as they are."""
        import torch

        if tensor.dim() < 2:
            raise ValueError("quantizable tensors have a token and a channel axis")
        tokens = tensor.shape[-2]
        keep = min(self.residual, tokens)
        body = tensor.narrow(-2, 0, tokens - keep).to(torch.float32)
        parts, record = ({}, {}) if body.numel() == 0 else self.encode(role, body.contiguous())
        record = {"shape": list(tensor.shape), "dtype": _st_name(tensor.dtype), "role": role,
                  "quantized_tokens": tokens - keep, "residual_tokens": keep, **record}
        if body.numel() == 0:
            parts = {"": torch.empty(0, dtype=torch.uint8)}
            record["empty"] = True
        if keep:
            parts["residual"] = tensor.narrow(-2, tokens - keep, keep).contiguous()
        return parts, record

    def dequantize(self, parts: dict[str, Any], record: dict, dtype=None):
        """The tensor :meth:`quantize` was given, approximately, in ``dtype`` (default: its own)."""
        import torch

        shape = list(record["shape"])
        dtype = dtype or getattr(torch, fmt.DTYPES[record["dtype"]][1])
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

    def encode(self, role: str, x) -> tuple[dict[str, Any], dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, role: str, parts: dict[str, Any], record: dict):  # pragma: no cover - abstract
        raise NotImplementedError

    def body_error_bound(self, role: str, x):  # pragma: no cover - abstract
        """Elementwise bound on the error of :meth:`encode` + :meth:`decode` on ``x`` (float32)."""
        raise NotImplementedError

    def error_bound(self, role: str, tensor):
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


# -- shared encoding helpers ---------------------------------------------------------------------

F16_MAX = 60000.0
F16_TINY = 6.2e-5  # smallest normal float16 is 6.1e-5


def round_up_param(t):
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


def round_down_param(t):
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


def safe_reciprocal(scale):
    import torch

    s = scale.to(torch.float32)
    return torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))


# -- plugin lookup ------------------------------------------------------------------------------


def quantizer_classes() -> dict[str, type[Quantizer]]:
    from kvcdn_core.plugins import get_host

    return get_host().quantizers()


def get_quantizer_class(scheme: str) -> type[Quantizer]:
    classes = quantizer_classes()
    cls = classes.get(scheme)
    if cls is None:
        hint = " (install it: pip install 'kvcdn[quant-lowbit]')" if scheme in ("int4", "int2") else ""
        raise KvcdnError(f"no installed quantizer provides scheme '{scheme}'{hint}; "
                         f"installed schemes: {', '.join(sorted(classes)) or 'none'}")
    return cls


def normalize_target_dtype(requested: str | None) -> tuple[str | None, str | None]:
    """``--target-dtype`` → ``(target float dtype or None, scheme implied by a storage dtype or None)``.

    F32/F16/BF16 are what the artifact dequantizes to on load. FP8 and I8 name the storage dtype
    instead: they choose the scheme that stores it (fp8, int8) and leave the target at the compute
    dtype. Everything else is refused with the reason and what to use.
    """
    if requested is None:
        return None, None
    name = requested.strip().upper()
    name = _DTYPE_ALIASES.get(name, name)
    if name in TARGET_DTYPES:
        return name, None
    if name in STORAGE_DTYPE_SCHEMES:
        return None, STORAGE_DTYPE_SCHEMES[name]
    if name in REFUSED_TARGETS:
        raise KvcdnError(f"target dtype {name} is not supported: {REFUSED_TARGETS[name]}")
    raise KvcdnError(f"unknown target dtype '{requested}': use F32, F16 or BF16 (what the artifact "
                     "dequantizes to on load), or FP8/I8 to pick the fp8/int8 storage scheme")


# -- quantizing a whole cache ---------------------------------------------------------------------


@dataclasses.dataclass
class ErrorStats:
    """Dequantization error of one tensor role (key, value) across the quantized layers."""

    max_abs: float = 0.0
    sum_abs: float = 0.0
    count: int = 0
    max_ref: float = 0.0  # largest |x| seen, to put max_abs in proportion

    def add(self, x, approx) -> None:
        diff = (x.float() - approx.float()).abs()
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sum_abs += float(diff.double().sum())
            self.count += diff.numel()
            self.max_ref = max(self.max_ref, float(x.float().abs().max()))

    def as_dict(self) -> dict:
        return {"max_abs": self.max_abs, "mean_abs": self.sum_abs / self.count if self.count else 0.0,
                "max_relative": self.max_abs / self.max_ref if self.max_ref else 0.0,
                "elements": self.count}


@dataclasses.dataclass
class QuantResult:
    manifest: dict
    tensors: dict[str, Any]
    errors: dict[str, ErrorStats]
    quantized_layers: int
    kept_layers: int


def quantize_cache(manifest: dict, tensors: dict[str, Any], quantizer: Quantizer,
                   target_dtype: str | None = None) -> QuantResult:
    """Quantize an unquantized artifact's tensors; returns the new manifest and stored tensors.

    ``manifest`` and ``tensors`` are what :func:`kvcdn_core.artifact.read_header` and
    :func:`kvcdn_core.artifact.load_tensors` give (or a freshly exported cache). The manifest's
    ``tensors`` table is rebuilt by the writer.
    """
    if manifest.get("quantization"):
        q = manifest["quantization"]
        raise KvcdnError(f"the input is already quantized (scheme {q.get('scheme')}); quantize the "
                         "unquantized artifact instead of stacking quantization errors")
    target = target_dtype or fmt.TORCH_TO_ST.get(manifest["compute_dtype"], "F32")
    if target not in TARGET_DTYPES:
        raise KvcdnError(f"target dtype {target} is not one of {', '.join(TARGET_DTYPES)}")
    stored = {fmt.TOKEN_IDS: tensors[fmt.TOKEN_IDS]}
    errors: dict[str, ErrorStats] = {}
    layer_records = []
    done = kept = 0
    for layer in manifest["layers"]:
        names = layer.get("tensors", {})
        if not quantizer.supports(layer["kind"]):
            kept += 1
            for full in names.values():
                stored[full] = tensors[full]
            layer_records.append({"index": layer["index"], "kind": layer["kind"], "action": "full_precision",
                                  "reason": f"scheme {quantizer.scheme} does not support {layer['kind']} layers"})
            continue
        records = {}
        for local, full in names.items():
            t = tensors[full]
            if not t.is_floating_point() or t.dim() < 2:
                stored[full] = t
                records[local] = {"name": full, "action": "full_precision", "reason": "not a float cache tensor"}
                continue
            role = role_of(local)
            parts, record = quantizer.quantize(role, t)
            for suffix, part in parts.items():
                stored[f"{full}.{suffix}" if suffix else full] = part
            record = {"name": full, "action": "quantized", "parts": sorted(parts), **record}
            records[local] = record
            errors.setdefault(role, ErrorStats()).add(t, quantizer.dequantize(parts, record))
        done += 1
        layer_records.append({"index": layer["index"], "kind": layer["kind"], "action": "quantized",
                              "tensors": records})
    new = copy.deepcopy(manifest)
    new.pop("tensors", None)
    new["created_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    new["quantization"] = {
        "version": QUANT_BLOCK_VERSION,
        "scheme": quantizer.scheme,
        "parameters": dict(quantizer.params),
        "target_dtype": target,
        "storage_dtype": quantizer.storage_dtype,
        "source_dtype": fmt.TORCH_TO_ST.get(manifest["compute_dtype"], manifest["compute_dtype"]),
        "source_created_at": manifest.get("created_at"),
        "layers": layer_records,
    }
    return QuantResult(new, stored, errors, done, kept)


# -- dequantizing on load ----------------------------------------------------------------------


def dequantize_tensors(header: fmt.Header, device: str = "cpu", verify_hashes: bool = True) -> dict[str, Any]:
    """Load a quantized artifact and return the tensors an unquantized one would hold.

    Same names (each layer's tensors and ``token_ids``), same shapes, in the target dtype;
    :func:`kvcdn_core.runtime.load_cache` calls this when the manifest has a ``quantization`` block.
    """
    import torch

    q = header.manifest.get("quantization") or {}
    try:
        version = int(q.get("version", 1))
        scheme = q["scheme"]
        target = q["target_dtype"]
        layer_records = q["layers"]
        params = q.get("parameters") or {}
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(f"{header.path}: corrupted: the quantization block lacks scheme, target_dtype or layers") from None
    if version > QUANT_BLOCK_VERSION:
        raise ArtifactError(f"{header.path}: quantization block version {version} is newer than this kvcdn reads "
                            f"({QUANT_BLOCK_VERSION}); upgrade kvcdn")
    if target not in TARGET_DTYPES:
        raise ArtifactError(f"{header.path}: unknown quantization target dtype {target!r}")
    quantizer = get_quantizer_class(scheme)(**params)
    dtype = getattr(torch, TARGET_DTYPES[target])
    raw = fmt.load_tensors(header, device=device, verify_hashes=verify_hashes)
    out = {fmt.TOKEN_IDS: raw[fmt.TOKEN_IDS]}
    by_index = {rec.get("index"): rec for rec in layer_records}
    for layer in header.manifest["layers"]:
        rec = by_index.get(layer["index"])
        if rec is None:
            raise ArtifactError(f"{header.path}: corrupted: the quantization block has no record for layer {layer['index']}")
        for local, full in layer.get("tensors", {}).items():
            trec = rec.get("tensors", {}).get(local) if rec.get("action") == "quantized" else None
            if trec is None or trec.get("action") != "quantized":
                out[full] = raw[full]
                continue
            try:
                parts = {p: raw[f"{full}.{p}" if p else full] for p in trec["parts"]}
                value = quantizer.dequantize(parts, trec, dtype)
            except (KeyError, RuntimeError, ValueError) as exc:
                raise ArtifactError(f"{header.path}: corrupted: cannot dequantize '{full}': {exc}") from None
            if list(value.shape) != list(trec["shape"]):
                raise ArtifactError(f"{header.path}: corrupted: '{full}' dequantizes to {list(value.shape)}, "
                                    f"the record says {trec['shape']}")
            out[full] = value
    return out


# -- files next to the output -----------------------------------------------------------------


def write_json_atomic(path, data: dict) -> None:
    """Write JSON atomically (see :mod:`kvcdn_core.atomic`)."""
    import json

    from kvcdn_core.atomic import atomic_open

    with atomic_open(path, text=True) as fh:
        json.dump(data, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


def event_path(output) -> "Path":
    from pathlib import Path

    return Path(str(output) + ".quant-event.json")


def default_output(source, scheme: str) -> "Path":
    """``<stem>.q8.kv`` for int8, ``<stem>.<scheme>.kv`` otherwise, next to ``source``."""
    from pathlib import Path

    source = Path(source)
    classes = quantizer_classes()
    suffix = classes[scheme].default_output_suffix() if scheme in classes else scheme
    stem = source.name[:-3] if source.name.endswith(".kv") else source.stem
    return source.with_name(f"{stem}.{suffix}.kv")


# -- the validation phase -------------------------------------------------------------------------

#: A reference step is a near-tie when its top-2 logit margin is below this fraction of its logit
#: range: any lossy cache may flip such a step, so the validation phase does not count it.
NEAR_TIE_FRACTION = 0.05


def compare_steps(reference_logits, quant_logits, near_tie: float = NEAR_TIE_FRACTION) -> dict:
    """Teacher-forced comparison: argmax agreement per step, and which disagreements are near-ties."""
    disagree, decisive, worst = [], [], 0.0
    for i, (a, b) in enumerate(zip(reference_logits, quant_logits)):
        worst = max(worst, float((a - b).abs().max()))
        if int(a.argmax()) == int(b.argmax()):
            continue
        top = a.topk(2).values
        margin = float(top[0] - top[1])
        disagree.append(i)
        if margin >= near_tie * float(a.max() - a.min()):
            decisive.append(i)
    return {"steps": len(reference_logits), "disagree": disagree, "decisive": decisive, "max_abs_logit_diff": worst}


#: The validation phase fails below this teacher-forced argmax agreement (a broken cache agrees on
#: almost no step; int8 on the tiny random models agrees on 14-16 of 16).
MIN_AGREEMENT = 0.75


def bound_violations(header_manifest: dict, original: dict, quantizer: Quantizer, dequantized: dict) -> list[str]:
    """Names of quantized tensors whose dequantized values leave the scheme's stated error bound."""
    bad = []
    for rec in header_manifest["quantization"]["layers"]:
        for local, trec in (rec.get("tensors") or {}).items():
            if trec.get("action") != "quantized":
                continue
            x = original[trec["name"]]
            err = (x.float() - dequantized[trec["name"]].float()).abs()
            if bool((err > quantizer.error_bound(trec["role"], x)).any()):
                bad.append(trec["name"])
    return bad


def validation_phase(scheme: str = "int8"):
    """A :mod:`kvcdn_core.validation` phase for ``scheme`` on a family's real cache.

    Quantize the run's artifact, check every dequantized tensor against the scheme's error bound,
    load it from disk and continue. Free-running token matches are reported; the pass criterion is a
    teacher-forced argmax agreement of at least :data:`MIN_AGREEMENT`, with flips at near-ties
    counted apart. Random-weight tiny models decode through near-ties (top-2 margins of 0.002 logits
    where int8 moves logits by about 0.05) and MoE routing decisions that any lossy cache can flip,
    so strict token equality there measures the model, not the scheme; docs/quantization.md shows
    int8 token-exact on trained models.
    """

    def phase(run):
        from kvcdn_core.verify import cached, reference

        name = f"quant:{scheme}"
        if run.header is None or run.reference_ids is None:
            return run.result(name, False, "skipped: an earlier phase failed")
        quantizer = get_quantizer_class(scheme)()
        original = fmt.load_tensors(run.header)
        result = quantize_cache(run.header.manifest, original, quantizer)
        path = run.workdir / f"{run.architecture}.{quantizer.default_output_suffix()}.kv"
        fmt.write_artifact(path, result.manifest, result.tensors)
        header = fmt.read_header(path)
        outside = bound_violations(header.manifest, original, quantizer, dequantize_tensors(header))
        ids, _, _ = cached(run.session, header, run.question_ids, run.n)
        _, ref_logits = reference(run.session, run.context_ids, run.question_ids, run.n)
        _, q_logits, _ = cached(run.session, header, run.question_ids, run.n, forced=run.reference_ids)
        cmp = compare_steps(ref_logits, q_logits)
        pairs = list(zip(run.reference_ids, ids))
        matches = sum(a == b for a, b in pairs)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        kept = f", {result.kept_layers} kept in full precision" if result.kept_layers else ""
        agree = cmp["steps"] - len(cmp["disagree"])
        ties = len(cmp["disagree"]) - len(cmp["decisive"])
        detail = (f"token match {matches}/{run.n}; teacher-forced argmax {agree}/{cmp['steps']}"
                  + (f" ({ties} flips at near-ties)" if ties else "")
                  + f", max |dlogit| {cmp['max_abs_logit_diff']:.3g}; {result.quantized_layers} layers quantized{kept}")
        if cmp["decisive"]:
            detail += f"; clear steps flipped: {cmp['decisive']}"
        if outside:
            detail += f"; outside the error bound: {', '.join(outside[:3])}"
        ok = not outside and len(ids) == run.n and agree >= MIN_AGREEMENT * cmp["steps"]
        return run.result(name, ok, detail, first)

    phase.__name__ = f"phase_quant_{scheme.replace('-', '_')}"
    return phase
