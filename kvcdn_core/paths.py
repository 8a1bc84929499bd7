"""Where kvcdn reads and writes by default (XDG base directories), the `.kv` suffix rule for
outputs, and the checks a command makes on its inputs and outputs before any slow work."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from kvcdn_core import notices
from kvcdn_core.errors import KvcdnError


def data_home() -> Path:
    """``$XDG_DATA_HOME/kvcdn`` or ``~/.local/share/kvcdn``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "kvcdn"


def config_home() -> Path:
    """``$XDG_CONFIG_HOME/kvcdn`` or ``~/.config/kvcdn``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(base) / "kvcdn"


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/kvcdn`` or ``~/.cache/kvcdn``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kvcdn"


def command_dir(command: str) -> Path:
    """The data directory of one command, e.g. ``~/.local/share/kvcdn/generate``."""
    return data_home() / command


def model_slug(model: str) -> str:
    """A model reference as a file-name fragment: ``Qwen/Qwen3-0.6B`` → ``Qwen_Qwen3-0.6B``.

    A local directory (``./tiny-qwen3``, ``/models/tiny-qwen3``, ``~/m``) gives its own name.
    """
    text = model.strip()
    if text.startswith((".", "/", "~", os.sep)):
        text = Path(text).expanduser().resolve().name
    return text.strip("/").replace("/", "_").replace(os.sep, "_") or "model"


def default_artifact_path(command: str, model: str) -> Path:
    """``<data>/<command>/<command>-<unix ms>-<model slug>.kv``."""
    ms = int(time.time() * 1000)
    return command_dir(command) / f"{command}-{ms}-{model_slug(model)}.kv"


def ensure_kv_suffix(path: str | os.PathLike, warn: bool = True) -> Path:
    """Append ``.kv`` to an explicit artifact path *to write* that lacks it, with the documented
    warning. A path to read is taken as given (:func:`input_artifact`)."""
    text = os.fspath(path)
    if text.endswith(".kv"):
        return Path(text)
    if warn:
        notices.warn(f"KV artifact path '{text}' does not end with '.kv'; appending '.kv'")
    return Path(text + ".kv")


def input_artifact(path: str | os.PathLike, option: str = "") -> Path:
    """An artifact to read, exactly as given: never renamed, and the real problem named when it is
    not a file (a wrong file is named by :func:`kvcdn_core.artifact.read_header`)."""
    given = Path(path)
    what = f"{option} '{given}'" if option else f"'{given}'"
    if given.is_dir():
        raise KvcdnError(f"{what} is a directory, not an artifact")
    if not given.exists():
        hint = f" (did you mean '{given}.kv'?)" if Path(f"{given}.kv").is_file() else ""
        raise KvcdnError(f"{what} does not exist{hint}")
    return given


def check_writable(path: Path) -> None:
    """Fail early, naming the user's path, when a file could not be created there.

    Nothing is left behind (a command that fails later leaves no empty directory): the nearest
    existing directory must let the missing ones be made at write time, which a probe file, created
    and removed at once, proves where permission bits cannot (root, read-only mounts, ``/proc``).
    """
    if path.is_dir():
        raise KvcdnError(f"cannot write '{path}': it is a directory")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise KvcdnError(f"cannot write '{path}': '{existing}' is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvcdn-probe-", dir=existing)
    except OSError as exc:
        raise KvcdnError(
            f"cannot write '{path}': cannot create files in '{existing}' ({exc.strerror or exc})"
        ) from None
    os.close(fd)
    os.unlink(probe)


def check_output(path: Path, force: bool, option: str = "--output") -> None:
    """The one rule for every file a command writes, checked before any model work: it can be
    created, and an existing file is replaced only with --force."""
    check_writable(path)
    if path.exists() and not force:
        raise KvcdnError(f"'{path}' exists; pass --force to replace it or {option} to choose another path")
