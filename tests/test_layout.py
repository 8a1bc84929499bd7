"""The module layout holds: grouped packages, layers that import only what sits below them, no import
cycle in core, no torch at import time, one caller of the plugin host, plugins on the public API.

Imports are read from the source (AST), counting those inside functions and under
``if TYPE_CHECKING:``: a cycle hidden by a deferred import is still a cycle.
"""

from __future__ import annotations

import ast
import inspect
import re
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


def public_module(name: str) -> bool:
    """``kvcdn_core.testing``, a public module (``kvcdn_core._MODULES``) or a module inside one."""
    parts = name.split(".")
    return parts[0] == "kvcdn_core" and len(parts) > 1 and parts[1] in {"testing", *kvcdn_core._MODULES}


def private_core_uses(path: Path) -> list[str]:
    """``file:line name`` for every use of core outside its public API."""
    public = set(kvcdn_core.__all__)
    bad = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("kvcdn_core.") and not public_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcdn_core"):
            if node.module == "kvcdn_core":
                names = [f"kvcdn_core.{a.name}" for a in node.names if a.name not in public]
            elif not public_module(node.module or ""):
                names = [node.module or ""]
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


#: What may sit at the top of kvcdn_core: the packages that show the architecture, and a few small
#: foundations every layer uses. ``artifact`` and ``runtime`` are public modules (``from kvcdn_core
#: import artifact, runtime``): the format's code is ``artifact/__init__.py``; the runtime stays one
#: module, since a ``runtime/`` package whose ``__init__`` loads models would run on every import of
#: a model helper (and close a cycle through the plugin host).
PACKAGES = {
    "artifact",  # the .kv format: header, manifest, digests, tensor reading, streaming
    "model",  # model files, fingerprints, defaults, extra layer kinds, the RoPE guard, tiny configs
    "exactness",  # continuing from an artifact against a full prefill; the per-architecture check
    "quant",  # quantization: codec, numerics, the quant service, the quantized validation phase
    "search",  # prefix search over artifacts
    "compose",  # cached documents composed out of prefix order: moved keys, selective recomputation
    "store",  # the chunk store
    "benchmark",  # kvcdn benchmark and its plots
    "plugin_host",  # hook specs, the plugin manager, lookup
    "cli",  # the kvcdn command, its commands and output
    "contracts",  # public: the plugin contracts
    "builtin",  # public: the built-in plugins
    "testing",  # public: the test API for plugins
}
#: ``settings`` is the declared-settings mechanism the server, the hosted client and the vLLM
#: connector share (public: ``from kvcdn_core import settings``); it imports only ``errors``.
FOUNDATIONS = {"errors", "text", "paths", "atomic", "notices", "progress", "cores", "settings"}
TOP_MODULES = {"__init__", "__main__", "runtime", *FOUNDATIONS}


def test_only_the_grouped_packages_and_foundations_sit_at_the_top():
    found = {p.stem for p in CORE.glob("*.py")} | {p.name for p in CORE.iterdir() if (p / "__init__.py").is_file()}
    assert found - TOP_MODULES - PACKAGES == set()
    assert found >= PACKAGES


#: Group → the groups it must not import (foundations may be imported by anyone). Lower layers stay
#: below: the format knows nothing of models, and no library layer knows the command line.
FORBIDDEN = {
    "artifact": set(PACKAGES) | {"runtime"},
    "model": {"runtime", "exactness", "quant", "search", "store", "benchmark", "cli", "builtin", "testing"},
    "contracts": {"runtime", "exactness", "quant", "search", "store", "benchmark", "cli", "plugin_host", "builtin"},
    "plugin_host": {"runtime", "model", "exactness", "quant", "search", "store", "benchmark", "cli", "builtin"},
    "store": {"runtime", "exactness", "quant", "search", "benchmark", "cli", "plugin_host", "builtin", "testing"},
    "search": {"exactness", "quant", "benchmark", "cli", "builtin", "testing"},
    "quant": {"search", "store", "benchmark", "cli", "builtin", "testing"},
    "exactness": {"search", "store", "benchmark", "cli", "builtin", "testing"},
    "runtime": {"exactness", "search", "store", "benchmark", "cli", "builtin", "testing", "compose"},
    "compose": {"exactness", "search", "store", "quant", "benchmark", "cli", "builtin", "testing"},
    **{name: (PACKAGES | {"runtime"}) - FOUNDATIONS for name in FOUNDATIONS},
}


def group_of(module: str) -> str:
    return (module.split(".") + [""])[1]


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if group_of(target) != group_of(module) and group_of(target) in FORBIDDEN.get(group_of(module), set())
    )


def test_each_layer_imports_only_what_sits_below_it():
    assert layering_violations(core_graph()) == []


def test_the_layering_check_catches_the_format_importing_a_model_helper():
    tree = ast.parse("def f():\n    from kvcdn_core.model.files import fingerprint\n")
    graph = {"kvcdn_core.artifact.manifest": imported_modules(tree, "kvcdn_core.artifact.manifest")}
    assert layering_violations(graph) == [
        "kvcdn_core.artifact.manifest imports kvcdn_core.model",
        "kvcdn_core.artifact.manifest imports kvcdn_core.model.files",
    ]


def test_only_the_command_line_and_the_builtin_commands_import_the_cli():
    users = {m for m, targets in core_graph().items() if any(group_of(t) == "cli" for t in targets)}
    assert {group_of(m) for m in users} - {"cli", "builtin", "__main__"} == set()


def module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level package names imported when the module itself is imported (not inside functions)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
    return found


def test_no_core_module_imports_torch_when_imported():
    """Import cost: torch and transformers load inside the functions that need them, so the CLI,
    search and the store start fast (store/ and search/ above all: they scan many headers)."""
    heavy = {"torch", "transformers"}
    assert {
        name: sorted(imports & heavy)
        for name, path in MODULES.items()
        if (imports := module_level_imports(ast.parse(path.read_text(encoding="utf-8")))) & heavy
    } == {}
    assert module_level_imports(ast.parse("import torch\ndef f():\n    import transformers\n")) == {"torch"}


def test_the_layer_tensor_naming_rule_is_written_once():
    """``layers.{i}.{role}`` lives in :func:`kvcdn_core.layer_tensor_name`: a writer or reader that
    spelled it again (core's adapter base, the vLLM connector and writer did) would drift."""
    spelled = re.compile(r"""f["']layers\.\{""")
    rule = Path(inspect.getsourcefile(kvcdn_core.layer_tensor_name) or "")
    sources = [p for p in CORE.rglob("*.py") if p != rule] + plugin_sources()
    again = [str(p.relative_to(ROOT)) for p in sources if spelled.search(p.read_text(encoding="utf-8"))]
    assert again == []
    assert spelled.search(rule.read_text(encoding="utf-8"))


def test_commands_open_an_artifacts_model_one_way():
    """A command that continues an artifact gets its session from ``commands.common.open_artifact``
    (the artifact's model, at its compute dtype), never by building one itself (quant did)."""
    import kvcdn_core.cli.commands
    import kvcdn_core.cli.commands.common

    common = Path(inspect.getsourcefile(kvcdn_core.cli.commands.common) or "")
    commands = Path(inspect.getsourcefile(kvcdn_core.cli.commands) or "").parent
    builders = [
        str(p.relative_to(ROOT))
        for p in sorted(commands.rglob("*.py"))
        if p != common and "session_for_artifact" in p.read_text(encoding="utf-8")
    ]
    assert builders == []
    assert "session_for_artifact" in common.read_text(encoding="utf-8")


def imported_packages(path: Path) -> set[str]:
    """The top-level packages a module imports (deferred imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def package_imports(package: str) -> set[str]:
    sources = list(ROOT.glob(f"plugins/*/{package}/**/*.py"))
    assert sources, package
    return set().union(*(imported_packages(p) for p in sources))


def test_server_and_client_share_only_the_wire_package():
    """The hosted API's contract is kvcdn-wire: the server never imports the client plugin, nor the
    client the server, and the wire package imports neither (nor core)."""
    server, client, wire = (package_imports(p) for p in ("kvcdn_server", "kvcdn_hosted", "kvcdn_wire"))
    assert "kvcdn_hosted" not in server and "kvcdn_server" not in client
    assert "kvcdn_wire" in server and "kvcdn_wire" in client
    assert not wire & {"kvcdn_core", "kvcdn_hosted", "kvcdn_server"}


def test_the_import_reader_sees_deferred_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import a.b\ndef f():\n    from kvcdn_hosted import wire\nfrom . import local\n")
    assert imported_packages(module) == {"a", "kvcdn_hosted"}


def test_the_artifact_module_keeps_its_name_wherever_it_is_imported():
    """One name for the format module everywhere (``artifact``), so a reader never meets it as ``fmt``."""
    renamed = []
    for path in [*CORE.rglob("*.py"), *ROOT.glob("plugins/*/*/**/*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "kvcdn_core":
                names = [(a.name, a.asname) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [("artifact", a.asname) for a in node.names if a.name == "kvcdn_core.artifact"]
            else:
                continue
            renamed += [
                f"{path.relative_to(ROOT)}:{node.lineno}"
                for name, asname in names
                if name == "artifact" and asname not in (None, "artifact")
            ]
    assert renamed == []
