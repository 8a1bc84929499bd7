"""``kvcdn quant``: write a quantized copy of an artifact (or of a freshly generated cache).

The input is only read. ``--verify`` loads the quantized artifact from disk, continues it, and
compares by token id with a full prefill (the reference) and with the unquantized artifact. The
``<output>.quant-event.json`` record is written atomically, also when verification fails.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import click

from kvcdn_core.cli.commands.common import (
    check_new_output,
    force_output_option,
    format_option,
    model_options,
    open_artifact,
    read_text_file,
)
from kvcdn_core.cli.render import render
from kvcdn_core.errors import CheckFailed, KvcdnError
from kvcdn_core.model.defaults import DEFAULT_MODEL, DEFAULT_QUESTION
from kvcdn_core.paths import ensure_kv_suffix, input_artifact


class SchemeOption(click.Option):
    """``--scheme``, whose help lists the schemes installed now (built-ins and plugins), each with its
    one-line description: asked of the registry only when help is shown, never at start-up."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from kvcdn_core.plugin_host.registry import quantizer_classes

        schemes = "; ".join(f"{name} ({cls.description})" for name, cls in sorted(quantizer_classes().items()))
        self.help = f"Quantization scheme [default: int8]. Installed: {schemes}."
        return super().get_help_record(ctx)


@click.command("quant")
@click.option("--kv-path", "input_path", default=None, help="Artifact to quantize (read, never overwritten).")
@click.option("--input", "old_input", default=None, hidden=True)  # the old name: one release with a warning
@click.option("--context-file", default=None, help="Document to generate the cache from, instead of --kv-path.")
@click.option(
    "--output",
    "-o",
    default=None,
    help="Quantized artifact [default: <input stem>.q8.kv for int8, <stem>.<scheme>.kv otherwise].",
)
@click.option("--scheme", cls=SchemeOption, default=None, help="Quantization scheme (the installed ones: see --help).")
@click.option(
    "--target-dtype",
    "target_dtype",
    default=None,
    metavar="F32|F16|BF16|FP8|I8",
    help="What the artifact dequantizes to on load (F32, F16, BF16) [default: its compute dtype]; "
    "FP8 or I8 choose the fp8 / int8 storage scheme instead.",
)
@click.option("--group-size", type=int, default=None, help="Elements per group (int4: 64, int2: 32).")
@click.option(
    "--residual", type=int, default=None, help="Most recent tokens kept unquantized (int4/int2; default 128)."
)
@click.option(
    "--verify",
    "do_verify",
    is_flag=True,
    help="Continue from the quantized artifact and compare with a full prefill; exit 1 on mismatch.",
)
@click.option("--n", "n", type=click.IntRange(1), default=8, show_default=True, help="Tokens to compare with --verify.")
@click.option(
    "--question",
    default=DEFAULT_QUESTION,
    help=f"Text fed after the context with --verify [default: {DEFAULT_QUESTION!r}].",
)
@model_options()
@force_output_option
@format_option
def command(
    input_path,
    old_input,
    context_file,
    output,
    scheme,
    target_dtype,
    group_size,
    residual,
    do_verify,
    n,
    question,
    model,
    revision,
    device,
    dtype,
    quiet,
    force,
    fmt,
):
    """Quantize a KV artifact: print the compression ratio and dequantization error, and with
    --verify check that continuing from it is token-exact against a full prefill."""
    from kvcdn_core import notices
    from kvcdn_core.quant import codec, service

    if old_input is not None:
        notices.warn("quant --input is deprecated; use --kv-path, as verify, diag and continue")
        input_path = input_path or old_input
    if bool(input_path) == bool(context_file):
        raise KvcdnError("pass exactly one of --kv-path (an artifact) or --context-file (a document)")
    target, implied = codec.normalize_target_dtype(target_dtype)
    if implied and scheme and scheme != implied and not (implied == "int8" and scheme == "int8-tensor"):
        raise KvcdnError(
            f"--target-dtype {target_dtype} is the storage dtype of scheme {implied}, "
            f"which contradicts --scheme {scheme}; drop one of them"
        )
    scheme = scheme or implied or "int8"
    from kvcdn_core.plugin_host.registry import quantizer_for

    quantizer = quantizer_for(scheme)(
        **{k: v for k, v in (("group_size", group_size), ("residual", residual)) if v is not None}
    )

    if input_path:
        source = input_artifact(input_path, "--kv-path")
    else:
        source = Path(context_file)
    out = ensure_kv_suffix(output) if output else service.default_output(source, scheme)
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        raise KvcdnError(f"output '{out}' is the input; kvcdn quant never overwrites its input, pass another --output")
    check_new_output(out, force)
    check_new_output(service.event_path(out), force)
    out.parent.mkdir(parents=True, exist_ok=True)

    temp_input = None
    try:
        from kvcdn_core import artifact, runtime

        session, header, source_kind = None, None, "artifact"
        if input_path and do_verify:  # the artifact's model, loaded and checked before anything is written
            from kvcdn_core.artifact.manifest import manifest_of

            session, header = open_artifact(source, model, revision, device, dtype)
            runtime.check_model(session, manifest_of(header))
        elif input_path:
            header = artifact.read_header(source)
        else:  # a document: its cache is generated first, as by kvcdn generate
            source_kind = "context"
            context = read_text_file(context_file)
            session = runtime.load_session(model or DEFAULT_MODEL, revision, device, dtype)
            fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".source.kv", dir=out.parent)
            os.close(fd)
            temp_input = Path(name)
            runtime.generate(session, context, temp_input, progress=not quiet)
            header = artifact.read_header(temp_input)
        event = service.quantize_artifact(
            header,
            out,
            quantizer,
            target,
            source if input_path else Path(context_file),
            source_kind,
            session,
            question,
            n if do_verify else None,
        )
    finally:
        if temp_input is not None:
            temp_input.unlink(missing_ok=True)
    render(event.as_dict(), fmt, _table)
    if event.verification == "Mismatch" and event.verify:
        v = event.verify
        raise CheckFailed(
            f"quantized continuation diverges from the full prefill at token "
            f"{v['first_divergence_reference']} ({v['reference_matches']}/{v['n']} match)"
        )


def _table(event: dict) -> None:
    click.echo(f"wrote {event['output']}")
    params = ", ".join(f"{k} {v}" for k, v in event["parameters"].items())
    click.echo(
        f"  scheme {event['scheme']}{f' ({params})' if params else ''}, storage {event['storage_dtype']}, "
        f"dequantizes to {event['target_dtype']}"
    )
    click.echo(
        f"  {event['tokens']} tokens, {event['quantized_layers']} layers quantized, "
        f"{event['full_precision_layers']} kept in full precision"
    )
    click.echo(
        f"  bytes {event['original_bytes']:,} -> {event['quantized_bytes']:,}: "
        f"compression {event['compression_ratio']:.2f}x"
    )
    for role, e in event["errors"].items():
        click.echo(
            f"  {role:<5} error: max {e['max_abs']:.3e}, mean {e['mean_abs']:.3e} "
            f"(max {100 * e['max_relative']:.2f}% of max |x|)"
        )
    v = event.get("verify")
    if v:
        click.echo(
            f"  verify ({v['n']} tokens): reference {v['reference_matches']}/{v['n']}, "
            f"unquantized {v['unquantized_matches']}/{v['n']}: {event['verification']}"
        )
        first = v["first_divergence_reference"]
        if first is None:
            click.echo("  first divergence: none")
        else:
            click.echo(
                f"  first divergence: index {first} (reference {v['reference_ids'][first]}, "
                f"quantized {v['quantized_ids'][first]})"
            )
    click.echo(f"  event: {event['event_path']}")
