"""``kvcdn inspect``: an artifact's manifest in human form, read without torch."""

from __future__ import annotations

import collections

import click

from kvcdn_core.cli.commands.common import format_option
from kvcdn_core.cli.render import emit_json
from kvcdn_core.errors import CheckFailed
from kvcdn_core.paths import input_artifact


@click.command("inspect")
@click.argument("path")
@click.option(
    "--check",
    is_flag=True,
    help="Re-hash every tensor against its digest in the manifest (BLAKE3; SHA-256 in format 1).",
)
@format_option
def command(path, check, fmt):
    """Show the manifest of the artifact at PATH (no model, no torch)."""
    from kvcdn_core import artifact
    from kvcdn_core.artifact.manifest import manifest_of, reuse_of

    header = artifact.read_header(input_artifact(path))
    m = header.manifest
    bad = artifact.check_hashes(header) if check else None
    if fmt == "json":
        out = {"path": str(header.path), "file_bytes": header.file_size, "manifest": m}
        if check:
            out["check"] = {"status": "OK" if not bad else "FAILED", "mismatched": bad}
        emit_json(out)
    else:
        model = m.get("model", {})
        typed = manifest_of(header)
        kinds = collections.Counter(layer.kind for layer in typed.layers)
        data_bytes = header.file_size - header.data_start
        click.echo(f"path:          {header.path}")
        click.echo(
            f"format:        {artifact.FORMAT_NAME} v{header.format_version} ({header.digest} digests), "
            f"written by kvcdn {m['kvcdn_version']} at {m['created_at']}"
        )
        click.echo(f"model:         {model.get('id')}" + (f" @ {model['revision']}" if model.get("revision") else ""))
        click.echo(f"architecture:  {model.get('architecture')} (family {model.get('family')})")
        click.echo(f"config sha256: {model.get('config_sha256')}")
        click.echo(f"tokenizer:     {model.get('tokenizer_sha256')}")
        click.echo(f"tokens:        {m['token_count']}, reuse {typed.declared_reuse or reuse_of(typed.layers)}")
        click.echo(f"dtype:         {m['compute_dtype']}")
        q = m.get("quantization")
        click.echo(f"quantization:  {q['scheme'] if q else 'none'}")
        click.echo(f"layers:        {len(typed.layers)} ({', '.join(f'{n} {k}' for k, n in kinds.items())})")
        for layer in typed.layers:
            if layer.kind == artifact.SLIDING_WINDOW:
                click.echo(
                    f"  layer {layer.index}: sliding window {layer.window}, cumulative length {layer.cumulative_length}"
                )
        click.echo(f"tensors:       {len(m['tensors'])}, {data_bytes / 1e6:.2f} MB of data")
        context = m.get("context") or ""
        preview = context[:120].replace("\n", " ")
        click.echo(f"context:       {len(context)} chars: {preview!r}{'...' if len(context) > 120 else ''}")
        if check:
            click.echo(
                f"check:         {f'OK, every tensor matches its {header.digest}' if not bad else 'FAILED: ' + ', '.join(bad)}"
            )
    if bad:
        raise CheckFailed(f"{len(bad)} tensor(s) do not match their {header.digest}: {', '.join(bad[:5])}")
