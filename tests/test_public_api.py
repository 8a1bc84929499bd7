"""The public API is typed for its users: the TYPE_CHECKING mirror in ``kvcdn_core/__init__.py`` names
exactly what the lazy ``__getattr__`` serves, and mypy sees real types through it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvcdn_core

ROOT = Path(__file__).resolve().parent.parent
INIT = ROOT / "kvcdn_core" / "__init__.py"


def mirrored() -> dict[str, str]:
    """Name → module of every import under ``if TYPE_CHECKING:`` in the package's ``__init__``."""
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    block = next(
        node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
    )
    names = {}
    for stmt in block.body:
        assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
        for alias in stmt.names:
            assert alias.asname == alias.name, (
                f"{alias.name} must be re-exported as itself ('{alias.name} as {alias.name}')"
            )
            module = stmt.module if stmt.module != "kvcdn_core" else f"kvcdn_core.{alias.name}"
            names[alias.name] = module
    return names


def test_the_type_checking_mirror_names_exactly_the_lazy_exports():
    expected = dict(kvcdn_core._EXPORTS)
    expected.update({name: f"kvcdn_core.{name}" for name in kvcdn_core._MODULES})
    assert mirrored() == expected


def test_every_public_name_resolves():
    for name in kvcdn_core.__all__:
        assert getattr(kvcdn_core, name) is not None, name


@pytest.mark.slow
def test_mypy_sees_real_types_in_a_third_party_plugin(tmp_path):
    """A plugin outside the tree, type-checked strictly: a wrong use of a public name is an error
    (it would pass silently if the names were ``Any``), and subclassing a contract is allowed."""
    plugin = tmp_path / "third_party.py"
    plugin.write_text(
        textwrap.dedent(
            """
            from kvcdn_core import ModelAdapter, open_storage

            backend = open_storage("file:///tmp")
            wrong: int = backend


            class Mine(ModelAdapter):
                family = "mine"
            """
        )
    )
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # as an installed package: mypy cannot see editable finders
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            plugin.name,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    out = result.stdout + result.stderr
    assert 'expression has type "StorageBackend", variable has type "int"' in out, out
    assert "Found 1 error in 1 file" in out, out
