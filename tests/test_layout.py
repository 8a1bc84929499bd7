"""The module layout holds: no import cycle in core, one caller of the plugin host, plugins on the public API.

Imports are read from the source (AST), counting those inside functions and under
``if TYPE_CHECKING:``: a cycle hidden by a deferred import is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvcdn_core

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kvcdn_core"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in CORE.rglob("*.py")}


def imported_modules(tree: ast.AST, current: str) -> set[str]:
    """Every core module an AST imports (a submodule import also runs its parent packages)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                package = current.rsplit(".", node.level)[0] if current in MODULES else current
                base = f"{package}.{base}".rstrip(".")
            for alias in node.names:
                targets.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            while target:
                found.add(target)
                target = target.rpartition(".")[0]
    # A package is initialised before its modules run, so a module importing its own package (or a
    # package importing its own modules) is the normal order of things, not a cycle.
    return {m for m in found if m != current and not current.startswith(m + ".") and not m.startswith(current + ".")}


def core_graph() -> dict[str, set[str]]:
    return {name: imported_modules(ast.parse(path.read_text(encoding="utf-8")), name) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_core_has_no_import_cycle():
    assert cycles(core_graph()) == []


def test_the_cycle_finder_finds_a_deferred_cycle():
    a = ast.parse("def f():\n    from kvcdn_core import runtime\n")
    b = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvcdn_core.quant.codec import x\n")
    graph = {
        "kvcdn_core.quant.codec": imported_modules(a, "kvcdn_core.quant.codec"),
        "kvcdn_core.runtime": imported_modules(b, "kvcdn_core.runtime"),
    }
    assert cycles(graph) == [["kvcdn_core.quant.codec", "kvcdn_core.runtime"]]


def test_contracts_depend_on_no_lookup_or_builtin():
    graph = core_graph()
    for name in (m for m in graph if m.startswith("kvcdn_core.contracts")):
        assert not {m for m in graph[name] if (m.split(".") + [""])[1] in ("plugin_host", "builtin", "runtime")}, name


def _host_users(paths) -> list[str]:
    users = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            host_names = {"get_host", "PluginHost", "set_host"}
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "kvcdn_core.plugin_host.manager"
                and {a.name for a in node.names} & host_names
            ):
                users.append(str(path.relative_to(ROOT)))
    return users


def test_registry_is_the_only_caller_of_the_plugin_host():
    allowed = {"kvcdn_core/plugin_host/registry.py", "kvcdn_core/testing/fixtures.py"}
    plugin_code = [p for p in ROOT.glob("plugins/*/*/**/*.py") if "tests" not in p.relative_to(ROOT).parts[2:]]
    assert sorted(set(_host_users([*CORE.rglob("*.py"), *plugin_code])) - allowed) == []


def plugin_sources() -> list[Path]:
    """Each plugin's package code (its tests may also use kvcdn_core.testing and test helpers)."""
    return sorted(
        p
        for p in ROOT.glob("plugins/*/*/**/*.py")
        if p.relative_to(ROOT).parts[2] != "tests" and "tests" not in p.parts[-2:-1]
    )


def private_core_uses(path: Path) -> list[str]:
    """``file:line name`` for every use of core outside its public API."""
    public = set(kvcdn_core.__all__)
    bad = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("kvcdn_core.") and a.name != "kvcdn_core.testing"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcdn_core"):
            if node.module == "kvcdn_core":
                names = [f"kvcdn_core.{a.name}" for a in node.names if a.name not in public]
            elif node.module != "kvcdn_core.testing":
                names = [node.module]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kvcdn_core":
            names = [] if node.attr in public else [f"kvcdn_core.{node.attr}"]
        bad += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names]
    return bad


def test_plugins_import_only_the_public_api():
    sources = plugin_sources()
    assert len(sources) > 10
    assert [use for path in sources for use in private_core_uses(path)] == []


def test_the_public_api_check_catches_a_private_import(tmp_path):
    bad = tmp_path / "plugin.py"
    bad.write_text("import kvcdn_core\nfrom kvcdn_core.cli.commands.common import emit_json\nkvcdn_core.plugin_host\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [u.split(" ")[1] for u in private_core_uses(bad)] == [
            "kvcdn_core.cli.commands.common",
            "kvcdn_core.plugin_host",
        ]
    finally:
        ROOT = saved


@pytest.mark.parametrize("name", sorted(kvcdn_core.__all__))
def test_every_public_name_resolves(name):
    assert getattr(kvcdn_core, name) is not None


def test_the_public_api_imports_no_torch():
    names = [n for n in kvcdn_core.__all__ if n != "runtime"]
    code = (
        "import sys, kvcdn_core\n"
        f"for name in {names!r}: getattr(kvcdn_core, name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_package_is_typed():
    packages = [CORE, *(p.parent for p in ROOT.glob("plugins/*/*/__init__.py") if p.parent.name != "tests")]
    assert [str(p.relative_to(ROOT)) for p in packages if not (p / "py.typed").is_file()] == []
