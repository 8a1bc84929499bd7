"""A directory where no file can be created, whoever runs the tests (root ignores permission bits)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def unwritable_dir(tmp_path: Path) -> Path:
    """A read-only directory; for root, who writes anywhere, ``/proc`` (no regular files there)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        return folder
    os.close(fd)
    os.unlink(probe)
    if Path("/proc/self").is_dir():
        return Path("/proc")
    pytest.skip("no directory here refuses new files to this user")
