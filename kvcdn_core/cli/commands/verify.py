"""``kvcdn verify``: continuing from the artifact must be token-exact against a full prefill."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvcdn_core import notices
from kvcdn_core.cli.commands.common import (
    artifact_path,
    composition_knobs,
    composition_options,
    force_option,
    format_option,
    model_options,
    open_artifact,
    open_artifacts,
    read_text_file,
)
from kvcdn_core.cli.render import emit_json
from kvcdn_core.errors import CheckFailed, KvcdnError
from kvcdn_core.model.defaults import DEFAULT_MODEL, DEFAULT_QUESTION
from kvcdn_core.paths import input_artifact


def prepare(command_name, model, revision, device, dtype, quiet, kv_path, context_file):
    """The artifact to check: the existing one at ``kv_path``, or one generated from the context.

    ``kv_path`` is the tuple of ``--kv-path`` values: with several, ``(session, [headers])`` of the
    artifacts to compose (they must exist).
    """
    from kvcdn_core import artifact, runtime

    if len(kv_path) > 1:
        if context_file:
            raise KvcdnError("--context-file generates one artifact; with several --kv-path pass existing artifacts")
        announce(quiet, f"loading the model of {kv_path[0]} ...")
        return open_artifacts(kv_path, model, revision, device, dtype)
    kv_path = kv_path[0] if kv_path else None

    if kv_path and Path(kv_path).exists():  # an artifact to read: taken as given, never renamed
        path = input_artifact(kv_path, "--kv-path")
        if context_file:
            notices.warn(f"--context-file ignored: '{path}' exists and carries its own context")
        announce(quiet, f"loading the model of {path} ...")
        return open_artifact(path, model, revision, device, dtype)
    if not context_file:
        if kv_path:
            raise KvcdnError(f"--kv-path '{kv_path}' does not exist; pass --context-file to generate it")
        raise KvcdnError("pass --kv-path of an existing artifact, or --context-file to generate one")
    path = artifact_path(kv_path, command_name, model or DEFAULT_MODEL)  # one to write: checked now
    if path.exists():  # never replaced silently, and never read under a name it was not given
        raise KvcdnError(f"'{path}' exists: pass --kv-path '{path}' to check it, or another path to generate")
    context = read_text_file(context_file)
    announce(quiet, f"loading the model {model or DEFAULT_MODEL} ...")
    session = runtime.load_session(model or DEFAULT_MODEL, revision, device, dtype)
    runtime.generate(session, context, path, progress=not quiet)
    if not quiet:
        click.echo(f"generated {path}", err=True)
    return session, artifact.read_header(path)


def announce(quiet: bool, text: str) -> None:
    """What a slow step is doing (a model load and two decodes take a while), on a terminal only,
    like the progress bars: a script's stderr keeps errors as its only lines."""
    if not quiet and on_terminal():
        click.echo(text, err=True)


def on_terminal() -> bool:
    return sys.stderr.isatty()


def check_options(f):
    for option in reversed(
        [
            model_options(),
            click.option(
                "--kv-path",
                multiple=True,
                help="Artifact to check; generated from --context-file when it does not exist. Repeat it to "
                "check the composition of several artifacts against the full prefill of their documents.",
            ),
            click.option("--context-file", default=None, help="Document to generate the artifact from."),
            click.option(
                "--question",
                default=DEFAULT_QUESTION,
                help=f"Text fed after the context on both paths [default: {DEFAULT_QUESTION!r}].",
            ),
            click.option(
                "--n", "n", type=click.IntRange(1), default=32, show_default=True, help="Tokens to decode greedily."
            ),
            force_option,
            format_option,
        ]
    ):
        f = option(f)
    return f


@click.command("verify")
@check_options
@composition_options()
def command(model, revision, device, dtype, quiet, kv_path, context_file, question, n, recompute, rule, force, fmt):
    """Check that continuing from an artifact is token-exact against a full prefill.

    Path A prefills context + question from scratch; path B loads the artifact from disk and feeds
    only the question. Both decode N tokens greedily and are compared by token id. Exit 0 on PASS,
    1 on MISMATCH. With --kv-path repeated, path B is the artifacts composed (--recompute, --select)
    and path A the full prefill of their documents in that order.
    """
    from kvcdn_core.exactness.against_prefill import run_verify, run_verify_composed

    recompute, rule = composition_knobs(kv_path, recompute, rule)
    session, header = prepare("verify", model, revision, device, dtype, quiet, kv_path, context_file)
    if isinstance(header, list):
        announce(quiet, f"decoding {n} tokens twice: from the composition, and after a full prefill ...")
        result, composition = run_verify_composed(session, header, question, n, recompute, rule, force=force)
        where, described = {"paths": [str(h.path) for h in header], **composition.as_dict()}, composition.summary()
    else:
        announce(
            quiet,
            f"decoding {n} tokens twice: from the artifact, and after a full prefill of its "
            f"{header.token_count} context tokens ...",
        )
        result = run_verify(session, header, question, n, force=force)
        where, described = {"path": str(header.path)}, f"artifact: {header.path}"
    if fmt == "json":
        emit_json({**where, "model": session.model_ref, **result.as_dict()})
    else:
        click.echo(f"{described} ({result.context_tokens} context + {result.question_tokens} question tokens)")
        click.echo(f"reference (full prefill): {result.reference_text!r}")
        label = "composed" if isinstance(header, list) else "artifact"
        click.echo(f"cached ({label}):        {result.cached_text!r}")
        status = "PASS" if result.passed else "MISMATCH"
        click.echo(f"token match: {result.matches}/{result.n} ({status})")
        first = result.first_divergence
        if first is None:
            click.echo("first divergence: none")
        else:
            click.echo(
                f"first divergence: index {first} (reference {result.reference_ids[first]}, "
                f"cached {result.cached_ids[first]})"
            )
    if not result.passed:
        raise CheckFailed(f"cached continuation diverges from the full prefill at token {result.first_divergence}")
