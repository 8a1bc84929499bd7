"""Where kvcdn reads and writes by default (XDG base directories) and the `.kv` suffix rule."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvcdn_core import notices


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
    """Append ``.kv`` to an explicit artifact path that lacks it, with the documented warning."""
    text = os.fspath(path)
    if text.endswith(".kv"):
        return Path(text)
    if warn:
        notices.warn(f"KV artifact path '{text}' does not end with '.kv'; appending '.kv'")
    return Path(text + ".kv")
