"""``kvcdn quant``: write a quantized copy of an artifact (or of a freshly generated cache).

The input is only read. ``--verify`` loads the quantized artifact from disk, continues it, and
compares by token id with a full prefill (the reference) and with the unquantized artifact. The
``<output>.quant-event.json`` record is written atomically, also when verification fails.
"""

from __future__ import annotations

import datetime as _dt
import os
import tempfile
import time
from pathlib import Path

import click

from kvcdn_core.commands.common import (check_new_output, emit_json, force_output_option, format_option,
                                        model_options, read_text_file)
from kvcdn_core.errors import CheckFailed, KvcdnError
from kvcdn_core.paths import ensure_kv_suffix
from kvcdn_core.runtime_defaults import DEFAULT_MODEL, DEFAULT_QUESTION

SCHEME_HELP = ("int8 (per-channel keys, per-token values; default), int8-tensor (one scale per tensor), "
               "fp8 (e4m3, per-token scales), int4 / int2 (grouped asymmetric; kvcdn-quant-lowbit plugin)")


@click.command("quant")
@click.option("--input", "input_path", default=None, help="Artifact to quantize (read, never overwritten).")
@click.option("--context-file", default=None, help="Document to generate the cache from, instead of --input.")
@click.option("--output", "-o", default=None,
              help="Quantized artifact [default: <input stem>.q8.kv for int8, <stem>.<scheme>.kv otherwise].")
@click.option("--scheme", default=None, help=f"Quantization scheme: {SCHEME_HELP}.")
@click.option("--target-dtype", "target_dtype", default=None, metavar="F32|F16|BF16|FP8|I8",
              help="What the artifact dequantizes to on load (F32, F16, BF16) [default: its compute dtype]; "
                   "FP8 or I8 choose the fp8 / int8 storage scheme instead.")
@click.option("--group-size", type=int, default=None, help="Elements per group (int4: 64, int2: 32).")
@click.option("--residual", type=int, default=None,
              help="Most recent tokens kept unquantized (int4/int2; default 128).")
@click.option("--verify", "do_verify", is_flag=True,
              help="Continue from the quantized artifact and compare with a full prefill; exit 1 on mismatch.")
@click.option("--n", "n", type=click.IntRange(1), default=8, show_default=True, help="Tokens to compare with --verify.")
@click.option("--question", default=DEFAULT_QUESTION, help=f"Text fed after the context with --verify [default: {DEFAULT_QUESTION!r}].")
@model_options()
@click.option("--compute-dtype", "legacy_compute_dtype", hidden=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None)
@force_output_option
@format_option
def command(input_path, context_file, output, scheme, target_dtype, group_size, residual, do_verify, n,
            question, model, revision, device, dtype, quiet, legacy_compute_dtype, force, fmt):
    """Quantize a KV artifact: print the compression ratio and dequantization error, and with
    --verify check that continuing from it is token-exact against a full prefill."""
    from kvcdn_core import quant

    if legacy_compute_dtype is not None:  # the old spelling, before --dtype meant the compute dtype everywhere
        click.echo("warning: --compute-dtype is deprecated; use --dtype (the compute dtype, as in every "
                   "model command)", err=True)
        dtype = legacy_compute_dtype
    if bool(input_path) == bool(context_file):
        raise KvcdnError("pass exactly one of --input (an artifact) or --context-file (a document)")
    target, implied = quant.normalize_target_dtype(target_dtype)
    if implied and scheme and scheme != implied and not (implied == "int8" and scheme == "int8-tensor"):
        raise KvcdnError(f"--target-dtype {target_dtype} is the storage dtype of scheme {implied}, "
                         f"which contradicts --scheme {scheme}; drop one of them")
    scheme = scheme or implied or "int8"
    quantizer = quant.get_quantizer_class(scheme)(
        **{k: v for k, v in (("group_size", group_size), ("residual", residual)) if v is not None})

    if input_path:
        source = ensure_kv_suffix(input_path)
        if not source.is_file():
            raise KvcdnError(f"input artifact '{source}' does not exist")
    else:
        source = Path(context_file)
    out = ensure_kv_suffix(output) if output else quant.default_output(source, scheme)
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        raise KvcdnError(f"output '{out}' is the input; kvcdn quant never overwrites its input, pass another --output")
    check_new_output(out, force)
    check_new_output(quant.event_path(out), force)
    out.parent.mkdir(parents=True, exist_ok=True)

    temp_input = None
    try:
        session, header, source_kind = None, None, "artifact"
        if input_path:
            from kvcdn_core import artifact

            header = artifact.read_header(source)
            if do_verify:  # load and check the model before anything is written
                from kvcdn_core import runtime

                session = _session_for(header.manifest, model, revision, device, dtype)
                runtime.check_model(session, header.manifest)
        else:
            from kvcdn_core import artifact, runtime

            source_kind = "context"
            context = read_text_file(context_file)
            session = runtime.load_session(model or DEFAULT_MODEL, revision, device, dtype)
            fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".source.kv", dir=out.parent)
            os.close(fd)
            temp_input = Path(name)
            runtime.generate(session, context, temp_input, progress=not quiet)
            header = artifact.read_header(temp_input)
        event = run_quant(header, out, quantizer, target, source if input_path else Path(context_file),
                          source_kind, session, question, n if do_verify else None)
    finally:
        if temp_input is not None:
            temp_input.unlink(missing_ok=True)
    _report(event, fmt)
    if event["verification"] == "Mismatch":
        v = event["verify"]
        raise CheckFailed(f"quantized continuation diverges from the full prefill at token "
                          f"{v['first_divergence_reference']} ({v['reference_matches']}/{v['n']} match)")


def _session_for(manifest, model, revision, device, dtype):
    from kvcdn_core import runtime

    named = manifest.get("model", {})
    dtype = dtype if dtype != "auto" else manifest.get("compute_dtype", "auto")
    return runtime.load_session(model or named.get("id") or DEFAULT_MODEL,
                                revision if revision is not None else (named.get("revision") if not model else None),
                                device, dtype)


def run_quant(header, out: Path, quantizer, target, source: Path, source_kind: str, session=None,
              question: str = DEFAULT_QUESTION, n: int | None = None) -> dict:
    """Quantize ``header``'s artifact into ``out``, optionally verify, write the event; return it."""
    from kvcdn_core import artifact, quant

    start = time.perf_counter()
    tensors = artifact.load_tensors(header)
    result = quant.quantize_cache(header.manifest, tensors, quantizer, target)
    artifact.write_artifact(out, result.manifest, result.tensors)
    seconds = time.perf_counter() - start
    q = result.manifest["quantization"]
    original, quantized = header.file_size, out.stat().st_size
    errors = {role: stats.as_dict() for role, stats in sorted(result.errors.items())}
    model = header.manifest.get("model", {})
    event = {
        "event": "kvcdn.quant",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "input": str(source), "input_kind": source_kind, "output": str(out),
        "model": model.get("id"), "architecture": model.get("architecture"),
        "scheme": quantizer.scheme, "parameters": dict(quantizer.params),
        "target_dtype": q["target_dtype"], "storage_dtype": q["storage_dtype"], "source_dtype": q["source_dtype"],
        "tokens": header.token_count, "layers": len(header.manifest["layers"]),
        "quantized_layers": result.quantized_layers, "full_precision_layers": result.kept_layers,
        "original_bytes": original, "quantized_bytes": quantized,
        "compression_ratio": round(original / quantized, 4) if quantized else None,
        "errors": errors, "max_error": max((e["max_abs"] for e in errors.values()), default=0.0),
        "seconds": round(seconds, 4),
        "verification": "Skipped", "mismatch_indices": [],
    }
    event["event_path"] = str(quant.event_path(out))
    if n is not None:
        try:
            event["verify"] = verify_quantized(session, header, artifact.read_header(out), question, n)
        except KvcdnError as exc:  # the record still says what was written and why verification stopped
            event["verification"], event["verification_error"] = "Error", str(exc)
            quant.write_json_atomic(quant.event_path(out), event)
            raise
        event["verification"] = "Match" if event["verify"]["reference_passed"] else "Mismatch"
        event["mismatch_indices"] = event["verify"]["mismatch_indices"]
    quant.write_json_atomic(quant.event_path(out), event)
    return event


def verify_quantized(session, source_header, quant_header, question: str, n: int) -> dict:
    """Token ids of the quantized artifact's continuation against a full prefill and the unquantized one."""
    from kvcdn_core import runtime, verify

    question_ids = session.adapter.encode_continuation(session.tokenizer, question)
    quant_ids, _, context_ids = verify.cached(session, quant_header, question_ids, n)
    plain_ids, _, _ = verify.cached(session, source_header, question_ids, n)
    reference_ids, _ = verify.reference(session, context_ids, question_ids, n)

    def first_diff(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

    mismatches = [i for i, (a, b) in enumerate(zip(reference_ids, quant_ids)) if a != b]
    return {
        "n": n, "question": question, "context_tokens": len(context_ids), "question_tokens": len(question_ids),
        "reference_matches": n - len(mismatches),
        "unquantized_matches": sum(a == b for a, b in zip(plain_ids, quant_ids)),
        "first_divergence_reference": first_diff(reference_ids, quant_ids),
        "first_divergence_unquantized": first_diff(plain_ids, quant_ids),
        "reference_passed": not mismatches and len(quant_ids) == len(reference_ids),
        "mismatch_indices": mismatches,
        "reference_ids": reference_ids, "quantized_ids": quant_ids, "unquantized_ids": plain_ids,
        "reference_text": runtime.decode(session, reference_ids),
        "quantized_text": runtime.decode(session, quant_ids),
    }


def _report(event: dict, fmt: str) -> None:
    if fmt == "json":
        emit_json(event)
        return
    click.echo(f"wrote {event['output']}")
    params = ", ".join(f"{k} {v}" for k, v in event["parameters"].items())
    click.echo(f"  scheme {event['scheme']}{f' ({params})' if params else ''}, storage {event['storage_dtype']}, "
               f"dequantizes to {event['target_dtype']}")
    click.echo(f"  {event['tokens']} tokens, {event['quantized_layers']} layers quantized, "
               f"{event['full_precision_layers']} kept in full precision")
    click.echo(f"  bytes {event['original_bytes']:,} -> {event['quantized_bytes']:,}: "
               f"compression {event['compression_ratio']:.2f}x")
    for role, e in event["errors"].items():
        click.echo(f"  {role:<5} error: max {e['max_abs']:.3e}, mean {e['mean_abs']:.3e} "
                   f"(max {100 * e['max_relative']:.2f}% of max |x|)")
    v = event.get("verify")
    if v:
        click.echo(f"  verify ({v['n']} tokens): reference {v['reference_matches']}/{v['n']}, "
                   f"unquantized {v['unquantized_matches']}/{v['n']}: {event['verification']}")
        first = v["first_divergence_reference"]
        if first is None:
            click.echo("  first divergence: none")
        else:
            click.echo(f"  first divergence: index {first} (reference {v['reference_ids'][first]}, "
                       f"quantized {v['quantized_ids'][first]})")
    click.echo(f"  event: {event['event_path']}")
