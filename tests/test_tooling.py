"""Lint, format and types: ruff and mypy, as configured in pyproject.toml, pass on the tree.

The same checks run before each commit through .pre-commit-config.yaml.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    executable = BIN / tool
    if not executable.exists():
        pytest.fail(f"{tool} is not installed next to {sys.executable}: pip install -e '.[test]'")
    return subprocess.run([str(executable), *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_ruff_lint():
    result = run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_ruff_format():
    result = run("ruff", "format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_mypy():
    result = run("mypy")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
