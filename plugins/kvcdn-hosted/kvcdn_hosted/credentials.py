"""Stored credentials: one JSON file, mode 0600, in ``$XDG_CONFIG_HOME/kvcdn/``, written atomically.

The file holds an API key and/or one OIDC session (tokens plus the issuer, client and token
endpoint they belong to). A session is used only against the issuer it came from. Every
read-modify-write holds :func:`locked`, so concurrent kvcdn processes never lose each other's
changes (a rotated refresh token above all).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

from kvcdn_core import KvcdnError, atomic_open, config_home, warn

FILE_NAME = "credentials.json"
_held = threading.local()


def credentials_path() -> Path:
    return config_home() / FILE_NAME


def load() -> dict[str, Any]:
    """The stored credentials (``{}`` when there are none)."""
    path = credentials_path()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return {}
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Someone widened it by hand: secrets must stay private, so narrow it back and say so.
        warn(f"{path} was readable by others; its mode is now 0600")
        os.chmod(path, 0o600)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvcdnError(f"credentials file {path} is unreadable ({exc}); remove it with kvcdn logout") from None
    if not isinstance(data, dict):
        raise KvcdnError(f"credentials file {path} is not a JSON object; remove it with kvcdn logout")
    return data


def save(data: dict[str, Any]) -> Path:
    """Replace the credentials file atomically (temp file 0600 in the same dir, fsync, rename)."""
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with atomic_open(path, text=True, mode=0o600) as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
    return path


@contextlib.contextmanager
def locked():
    """Hold the credentials' lock (``flock`` on their directory) across a read-modify-write.

    Refreshing a session reads the refresh token, spends it at the issuer (which, rotating tokens,
    invalidates it) and stores the new one: two processes doing that at once would spend the same
    token twice, and one would store a dead token. Re-entrant within a thread.
    """
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path.parent, os.O_RDONLY)  # the directory: no lock file to leave behind
    try:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no flock; best effort
            fcntl = None
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0
    finally:
        os.close(fd)  # releases the lock


def update(**changes: Any) -> dict[str, Any]:
    """Set (or, with ``None``, remove) top-level entries and save; return the new content."""
    with locked():
        data = load()
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        if data:
            save(data)
        else:
            clear()
        return data


def clear() -> bool:
    """Remove the credentials file; ``True`` when there was one."""
    try:
        credentials_path().unlink()
        return True
    except FileNotFoundError:
        return False
