"""``kvcdn store``: artifacts kept as content-addressed chunks in any storage backend (docs/store.md).

The commands parse, call :class:`kvcdn_core.store.chunkstore.ChunkStore` and render; no torch.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvcdn_core.cli.commands.common import check_new_output, force_output_option, format_option
from kvcdn_core.cli.render import print_table, render
from kvcdn_core.errors import CheckFailed
from kvcdn_core.notices import warn

store_option = click.option(
    "--store",
    "uri",
    required=True,
    help="The store: a directory, file://, s3://bucket/prefix, kvcdn:// (the hosted service) or another installed backend's URI.",
)


def _open(uri: str):
    """The chunk store at ``uri``: the backend's own when it keeps one (the hosted endpoint), else
    core's on its bytes."""
    from kvcdn_core.plugin_host.registry import open_storage
    from kvcdn_core.store.chunkstore import open_chunk_store

    return open_chunk_store(open_storage(uri))


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


@click.group("store")
def command():
    """Keep artifacts as token chunks stored once by content, with a small record per artifact."""


@command.command("put")
@click.argument("file")
@store_option
@click.option("--name", default=None, help="Name in the store [default: the file's stem].")
@click.option("--force", is_flag=True, help="Replace an artifact of that name in the store.")
@format_option
def put(file, uri, name, force, fmt):
    """Store the .kv FILE: upload the chunks the store lacks, then its record."""
    from kvcdn_core.paths import ensure_kv_suffix

    report = _open(uri).put(ensure_kv_suffix(file), name, force=force)

    def table(r):
        click.echo(
            f"stored '{r.name}': {r.tokens} tokens, {r.chunks} chunk(s), {r.chunks_new} new, "
            f"{r.chunks_shared} already in the store, {r.chunks_pieced} built on a stored prefix; moved {_mb(r.bytes_moved)}, saved {_mb(r.bytes_saved)}"
        )

    render(report.as_dict(), fmt, lambda _d: table(report))


@command.command("get")
@click.argument("name")
@store_option
@click.option("--output", "-o", default=None, help="Where to write the .kv file [default: NAME.kv].")
@force_output_option
@format_option
def get(name, uri, output, force, fmt):
    """Rebuild artifact NAME as a .kv file, byte-identical to the one stored."""
    from kvcdn_core.paths import ensure_kv_suffix

    target = ensure_kv_suffix(output) if output else Path(f"{name}.kv")
    check_new_output(target, force)
    report = _open(uri).get(name, target)
    render(
        report.as_dict(),
        fmt,
        lambda r: click.echo(f"wrote {r['path']}: {_mb(r['file_bytes'])}, fetched {_mb(r['bytes_fetched'])}"),
    )


@command.command("ls")
@store_option
@format_option
def ls(uri, fmt):
    """List the store's artifacts: tokens, chunks, chunks shared with others, bytes."""
    rows = [r.as_dict() for r in _open(uri).listing(on_error=warn)]

    def table(data):
        if not data:
            click.echo("no artifacts in the store")
            return
        lines = [("NAME", "TOKENS", "CHUNKS", "SHARED", "BYTES", "REUSE", "MODEL")]
        lines += [
            (r["name"], r["tokens"], r["chunks"], r["shared_chunks"], r["bytes"], r["reuse"], r["model"]) for r in data
        ]
        print_table(lines, right=(1, 2, 3, 4))

    render(rows, fmt, table)


@command.command("inspect")
@click.argument("name")
@store_option
@format_option
def inspect(name, uri, fmt):
    """Show artifact NAME's chunks and how many other artifacts share each."""
    record, rows = _open(uri).chunk_table(name)
    out = {
        "name": record.name,
        "tokens": record.token_count,
        "file_bytes": record.size,
        "reuse": record.reuse,
        "model": record.model,
        "root": record.root,
        "chunk_tokens": record.chunk_tokens,
        "chunked_tensors": len(record.chunked),
        "shared_chunks": len({r["chunk"] for r in rows if r["key"] and r["shared_with"]}),
        "chunks": rows,
    }

    def table(d):
        click.echo(
            f"{d['name']}: {d['tokens']} tokens, {_mb(d['file_bytes'])}, reuse {d['reuse']}, model {d['model'].get('id')}"
        )
        click.echo(
            f"{len(record.chunks)} chunk(s) of {d['chunk_tokens']} tokens over {d['chunked_tensors']} tensor(s), "
            f"{d['shared_chunks']} shared with other artifacts"
        )
        lines = [("CHUNK", "TOKENS", "KEY", "DIGEST", "BYTES", "SHARED WITH")]
        for r in rows:
            span = f"{r['tokens'][0]}-{r['tokens'][1]}" if r["tokens"] else "tail"
            chunk = "" if r["chunk"] is None else r["chunk"]
            lines.append((chunk, span, (r["key"] or "")[:16], r["digest"][:16], r["bytes"], r["shared_with"]))
        print_table(lines, right=(0, 4, 5))

    render(out, fmt, table)


@command.command("rm")
@click.argument("name")
@store_option
@format_option
def rm(name, uri, fmt):
    """Remove artifact NAME (its record); gc reclaims chunks no other artifact uses."""
    record = _open(uri).delete(name)
    render({"name": record.name, "removed": True}, fmt, lambda d: click.echo(f"removed '{d['name']}'"))


@command.command("check")
@store_option
@click.option(
    "--repair",
    is_flag=True,
    help="Also rebuild the prefix index from the records (after a put or delete died between the two).",
)
@format_option
def check(uri, repair, fmt):
    """Check every chunk against its digest and every record's references; exit 1 on a problem."""
    store = _open(uri)
    report = store.check()
    if repair:
        click.echo(f"prefix index rebuilt: {store.rebuild_index()} artifact(s)", err=True)

    def table(d):
        click.echo(
            f"{d['records']} artifact(s), {d['chunks']} chunk(s) ({_mb(d['chunk_bytes'])}); "
            f"{d['orphans']} orphan chunk(s) ({_mb(d['orphan_bytes'])}) for gc; "
            f"{d['pending']} put(s) in progress"
        )
        for problem in d["problems"]:
            click.echo(f"problem: {problem}")
        click.echo("OK" if not d["problems"] else f"FAILED: {len(d['problems'])} problem(s)")

    render(report.as_dict(), fmt, table)
    if not report.ok:
        raise CheckFailed(f"the store has {len(report.problems)} problem(s), first: {report.problems[0]}")


@command.command("gc")
@store_option
@format_option
def gc(uri, fmt):
    """Delete chunks no artifact references (and those of puts that died a day ago or more)."""
    report = _open(uri).gc()
    render(
        report.as_dict(),
        fmt,
        lambda d: click.echo(
            f"deleted {d['chunks_deleted']} chunk(s), reclaimed {_mb(d['bytes_reclaimed'])}; "
            f"{d['chunks_kept']} chunk(s) kept for {d['records']} artifact(s); "
            f"{d['pending_expired']} expired put marker(s) removed"
        ),
    )
