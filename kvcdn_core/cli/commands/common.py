"""Options and helpers that several commands share, so each is spelled one way."""

from __future__ import annotations

from pathlib import Path

import click

from kvcdn_core.errors import KvcdnError
from kvcdn_core.paths import check_output, check_writable, default_artifact_path, ensure_kv_suffix


def model_options(from_artifact: bool = True):
    """``--model --revision --device --dtype --quiet``: how to load the model.

    ``from_artifact``: the command reads an artifact, whose manifest names the default model.
    """
    from kvcdn_core.model.defaults import DEFAULT_MODEL

    default_help = f"the artifact's model, else {DEFAULT_MODEL}" if from_artifact else DEFAULT_MODEL

    def decorate(f):
        options = [
            click.option(
                "--model", "model", default=None, help=f"Hugging Face id or local directory [default: {default_help}]"
            ),
            click.option("--revision", default=None, help="Model revision (branch, tag or commit) on the hub."),
            click.option(
                "--device",
                type=click.Choice(["auto", "cpu", "cuda", "mps"]),
                default="auto",
                show_default=True,
                help="Where to run the model.",
            ),
            click.option(
                "--dtype",
                type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                default="auto",
                show_default=True,
                help="Compute dtype; auto is float32 on CPU, bfloat16 on CUDA.",
            ),
            click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
        ]
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


format_option = click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="Output for people (table) or tools (json).",
)
force_option = click.option(
    "--force", is_flag=True, help="Use an artifact even if it was made with another model or dtype."
)

force_output_option = click.option("--force", is_flag=True, help="Replace an existing output file.")


def check_new_output(path: Path, force: bool, option: str = "--output") -> None:
    """The one rule for every file a command writes (:func:`kvcdn_core.paths.check_output`), called
    before any model work: it can be created, and an existing file is replaced only with --force."""
    check_output(path, force, option)


def read_text_file(path: str, what: str = "context file") -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvcdnError(f"{what} '{path}' does not exist") from None
    except IsADirectoryError:
        raise KvcdnError(f"{what} '{path}' is a directory") from None
    except UnicodeDecodeError:
        raise KvcdnError(f"{what} '{path}' is not UTF-8 text") from None
    if not text.strip():
        raise KvcdnError(f"{what} '{path}' is empty")
    return text


def artifact_path(explicit: str | None, command: str, model: str, for_writing: bool = True) -> Path:
    """The artifact path a command uses; checked for writing before any model work starts."""
    path = ensure_kv_suffix(explicit) if explicit else default_artifact_path(command, model)
    if for_writing:
        check_writable(path)
    return path


def open_artifact(path: Path, model: str | None, revision: str | None, device: str, dtype: str):
    """Read an artifact's header and load the model it names (or ``model``): ``(session, header)``."""
    from kvcdn_core import artifact, runtime
    from kvcdn_core.artifact.manifest import manifest_of

    header = artifact.read_header(path)
    return runtime.session_for_artifact(manifest_of(header), model, revision, device, dtype), header


def open_artifacts(paths, model: str | None, revision: str | None, device: str, dtype: str):
    """Several artifacts to compose: ``(session, headers)``, the model named by the first."""
    from kvcdn_core import artifact
    from kvcdn_core.paths import input_artifact

    found = [input_artifact(p, "--kv-path") for p in paths]
    session, first = open_artifact(found[0], model, revision, device, dtype)
    return session, [first] + [artifact.read_header(p) for p in found[1:]]


class _ShareOrAuto(click.ParamType):
    """A share from 0 to 1, or ``auto`` (diag: the smallest share of a ladder under ``--max-kl``)."""

    name = "R|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, float):
            return value
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not 0.0 <= share <= 1.0:
            self.fail(f"{value!r} is not a share from 0 to 1, nor auto", param, ctx)
        return share


def composition_options(auto: bool = False):
    """``--recompute --select``: how several ``--kv-path`` artifacts are composed into one prompt.

    ``auto``: ``--recompute`` also takes ``auto`` (``kvcdn diag`` with ``--max-kl``).
    """
    from kvcdn_core.model.defaults import COMPOSE_RULES as RULES
    from kvcdn_core.model.defaults import DEFAULT_COMPOSE_RULE as DEFAULT_RULE
    from kvcdn_core.model.defaults import DEFAULT_RECOMPUTE

    def decorate(f):
        f = click.option(
            "--select",
            "rule",
            type=click.Choice(RULES),
            default=None,
            help=f"With several --kv-path: how the tokens to recompute are chosen [default: {DEFAULT_RULE}].",
        )(f)
        return click.option(
            "--recompute",
            type=_ShareOrAuto() if auto else click.FloatRange(0.0, 1.0),
            default=None,
            help="With several --kv-path: the share of the later documents' tokens recomputed, 0 to 1; "
            + ("auto: the smallest share whose mean KL is within --max-kl; " if auto else "")
            + f"1 is the full prefill [default: {DEFAULT_RECOMPUTE}].",
        )(f)

    return decorate


def composition_knobs(paths, recompute, rule):
    """``(recompute, rule)`` with their defaults; refused when there is nothing to compose."""
    from kvcdn_core.model.defaults import DEFAULT_COMPOSE_RULE as DEFAULT_RULE
    from kvcdn_core.model.defaults import DEFAULT_RECOMPUTE

    if len(paths) < 2 and (recompute is not None or rule is not None):
        raise KvcdnError("--recompute and --select compose several artifacts: pass two or more --kv-path")
    return (DEFAULT_RECOMPUTE if recompute is None else recompute), (rule or DEFAULT_RULE)


def text_or_file(text: str | None, path: str | None, what: str) -> str:
    """The text of ``--<what>`` or of ``--<what>-file``: exactly one, and not empty."""
    if (text is None) == (path is None):
        raise KvcdnError(f"pass exactly one of --{what} and --{what}-file")
    if path is not None:
        return read_text_file(path, f"{what} file")
    if not text:
        raise KvcdnError(f"the {what} is empty")
    return text
