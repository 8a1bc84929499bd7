"""The quantization service: what ``kvcdn quant`` calls.

Quantize an artifact into another file, optionally verify that continuing from it matches a full
prefill, and record a typed :class:`QuantEvent` next to it. The numerics live in
:mod:`kvcdn_core.quant.codec` (which runtime uses to dequantize on load); this module sits above both.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import time
from pathlib import Path
from typing import Any

from kvcdn_core import artifact, notices
from kvcdn_core.artifact.manifest import manifest_of
from kvcdn_core.atomic import write_json_atomic
from kvcdn_core.contracts.quantizer import Quantizer
from kvcdn_core.errors import KvcdnError
from kvcdn_core.model.defaults import DEFAULT_QUESTION
from kvcdn_core.plugin_host.registry import quantizer_classes
from kvcdn_core.quant.codec import quantize_cache


@dataclasses.dataclass
class QuantEvent:
    """What one quantization did: written as ``<output>.quant-event.json`` and printed by ``kvcdn quant``."""

    timestamp: str
    input: str
    input_kind: str  # artifact | context
    output: str
    model: str | None
    architecture: str | None
    scheme: str
    parameters: dict[str, int]
    target_dtype: str
    storage_dtype: str
    source_dtype: str
    tokens: int
    layers: int
    quantized_layers: int
    full_precision_layers: int
    original_bytes: int
    quantized_bytes: int
    compression_ratio: float | None
    errors: dict[str, dict[str, float]]
    max_error: float
    seconds: float
    event_path: str
    verification: str = "Skipped"  # Skipped | Match | Mismatch | Error
    mismatch_indices: list[int] = dataclasses.field(default_factory=list)
    verify: dict[str, Any] | None = None
    verification_error: str | None = None
    event: str = "kvcdn.quant"

    def as_dict(self) -> dict[str, Any]:
        data = {"event": self.event, **dataclasses.asdict(self)}
        for optional in ("verify", "verification_error"):
            if data[optional] is None:
                del data[optional]
        return data

    def write(self) -> None:
        write_json_atomic(self.event_path, self.as_dict())


def event_path(output: str | os.PathLike[str]) -> Path:
    """Where the event of a quantization into ``output`` is recorded."""
    return Path(str(output) + ".quant-event.json")


def default_output(source: str | os.PathLike[str], scheme: str) -> Path:
    """``<stem>.q8.kv`` for int8, ``<stem>.<scheme>.kv`` otherwise, next to ``source``."""
    source = Path(source)
    classes = quantizer_classes()
    suffix = classes[scheme].default_output_suffix() if scheme in classes else scheme
    stem = source.name[:-3] if source.name.endswith(".kv") else source.stem
    return source.with_name(f"{stem}.{suffix}.kv")


def quantize_artifact(
    header: artifact.Header,
    out: Path,
    quantizer: Quantizer,
    target: str | None,
    source: Path,
    source_kind: str = "artifact",
    session: Any = None,
    question: str = DEFAULT_QUESTION,
    n: int | None = None,
) -> QuantEvent:
    """Quantize ``header``'s artifact into ``out``; with ``n``, verify ``n`` tokens against a full
    prefill on ``session``. The event is written next to ``out`` also when verification fails."""
    start = time.perf_counter()
    tensors = artifact.load_tensors(header)
    typed = manifest_of(header)
    result = quantize_cache(typed, tensors, quantizer, target)
    artifact.write_artifact(out, result.manifest, result.tensors)
    seconds = time.perf_counter() - start
    q = result.manifest["quantization"]
    original, quantized = header.file_size, out.stat().st_size
    if quantized >= original:
        _warn_not_smaller(original, quantized, header.token_count, quantizer.params)
    errors = {role: stats.as_dict() for role, stats in sorted(result.errors.items())}
    model = typed.model
    event = QuantEvent(
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        input=str(source),
        input_kind=source_kind,
        output=str(out),
        model=model.id,
        architecture=model.architecture,
        scheme=quantizer.scheme,
        parameters=dict(quantizer.params),
        target_dtype=q["target_dtype"],
        storage_dtype=q["storage_dtype"],
        source_dtype=q["source_dtype"],
        tokens=header.token_count,
        layers=len(typed.layers),
        quantized_layers=result.quantized_layers,
        full_precision_layers=result.kept_layers,
        original_bytes=original,
        quantized_bytes=quantized,
        compression_ratio=round(original / quantized, 4) if quantized else None,
        errors=errors,
        max_error=max((e["max_abs"] for e in errors.values()), default=0.0),
        seconds=round(seconds, 4),
        event_path=str(event_path(out)),
    )
    if n is not None:
        try:
            event.verify = verify_quantized(session, header, artifact.read_header(out), question, n)
        except KvcdnError as exc:  # the record still says what was written and why verification stopped
            event.verification, event.verification_error = "Error", str(exc)
            event.write()
            raise
        event.verification = "Match" if event.verify["reference_passed"] else "Mismatch"
        event.mismatch_indices = event.verify["mismatch_indices"]
    event.write()
    return event


def _warn_not_smaller(original: int, quantized: int, tokens: int, params: dict[str, Any]) -> None:
    """A quantized copy that is not smaller than its input is almost always a mistake: say so, and why."""
    residual = params.get("residual")
    if residual is not None and residual >= tokens:
        why = (
            f"the residual window ({residual} tokens) covers all {tokens} tokens, so nothing was quantized; "
            "pass a smaller --residual"
        )
    else:
        why = "the scales and layout it adds outweigh what quantization saved on so short a cache"
    notices.warn(
        f"the quantized artifact ({quantized:,} bytes) is not smaller than its input ({original:,} bytes): {why}"
    )


def verify_quantized(
    session: Any, source_header: artifact.Header, quant_header: artifact.Header, question: str, n: int
) -> dict[str, Any]:
    """Token ids of the quantized artifact's continuation against a full prefill and the unquantized one."""
    from kvcdn_core import runtime
    from kvcdn_core.exactness import against_prefill

    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    quant_ids, _, context_ids = against_prefill.cached(session, quant_header, question_ids, n)
    plain_ids, _, _ = against_prefill.cached(session, source_header, question_ids, n)
    reference_ids, _ = against_prefill.reference(session, context_ids, question_ids, n)

    def first_diff(a: list[int], b: list[int]) -> int | None:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

    mismatches = [i for i, (a, b) in enumerate(zip(reference_ids, quant_ids)) if a != b]
    return {
        "n": n,
        "question": question,
        "context_tokens": len(context_ids),
        "question_tokens": len(question_ids),
        "reference_matches": n - len(mismatches),
        "unquantized_matches": sum(a == b for a, b in zip(plain_ids, quant_ids)),
        "first_divergence_reference": first_diff(reference_ids, quant_ids),
        "first_divergence_unquantized": first_diff(plain_ids, quant_ids),
        "reference_passed": not mismatches and len(quant_ids) == len(reference_ids),
        "mismatch_indices": mismatches,
        "reference_ids": reference_ids,
        "quantized_ids": quant_ids,
        "unquantized_ids": plain_ids,
        "reference_text": runtime.decode(session, reference_ids),
        "quantized_text": runtime.decode(session, quant_ids),
    }
