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


def _mypy_config() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]


def test_mypy_covers_every_plugin_and_checks_contract_plugins_strictly():
    """Every plugin package is type-checked; those implementing a contract (model families,
    quantizers, storage backends) at the contracts' own strict level."""
    config = _mypy_config()
    checked = {p.parent for pattern in config["files"] for p in ROOT.glob(pattern) if p.name == "__init__.py"}
    packages = {p.parent for p in ROOT.glob("plugins/*/kvcdn_*/__init__.py")}
    assert packages and packages <= checked, sorted(str(p.relative_to(ROOT)) for p in packages - checked)

    def flags(block: dict) -> dict:
        return {k: v for k, v in block.items() if k != "module"}

    contracts = next(b for b in config["overrides"] if "kvcdn_core.contracts.*" in b["module"])
    strict = {
        module.removesuffix(".*")
        for block in config["overrides"]
        if flags(block) == flags(contracts) and block is not contracts
        for module in block["module"]
    }
    implementers = {
        p.name for p in packages if p.parent.name.startswith(("kvcdn-model-", "kvcdn-quant-", "kvcdn-storage-"))
    }
    assert implementers and implementers <= strict, sorted(implementers - strict)
