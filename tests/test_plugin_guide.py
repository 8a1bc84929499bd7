"""docs/plugin-guide.md: every hook, contract method and manifest member is documented with its
signature, and each example plugin, cut from the guide and installed as its own package (into a
scratch directory, so this environment's plugin set never changes), does what the guide says: the
model family validates and passes the adapter contract, the storage and quantizer examples pass
their contract suites."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcdn_core.artifact.manifest import LayerEntry, Manifest
from kvcdn_core.contracts.adapter import ModelAdapter
from kvcdn_core.contracts.quantizer import Quantizer
from kvcdn_core.contracts.storage import StorageBackend
from kvcdn_core.plugin_host import hookspecs
from tests.support import plugin_examples

GUIDE = plugin_examples.GUIDE
TEXT = GUIDE.read_text(encoding="utf-8")


def signature(function, name: str) -> str:
    """``name(a, b, c=None)``: how the guide writes a signature (no self, defaults as Python)."""
    params = list(inspect.signature(function).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    shown = []
    for p in params:
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.default is not p.empty:
            text += "=" + ('""' if p.default == "" else repr(p.default))
        shown.append(text)
    return f"{name}({', '.join(shown)})"


def contract_members(cls: type) -> list[tuple[str, str]]:
    """(name, documented form) of every public method and property a contract class defines."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            found.append((name, name))
        elif isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value):
            found.append((name, signature(getattr(value, "__func__", value), name)))
    return found


HOOKS = [name for name in dir(hookspecs) if name.startswith("kvcdn_")]
MEMBERS = [
    (cls.__name__, name, form)
    for cls in (ModelAdapter, Quantizer, StorageBackend, LayerEntry, Manifest)
    for name, form in contract_members(cls)
]


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_with_its_signature(hook):
    assert getattr(hookspecs, hook).__doc__.strip()
    assert f"`{signature(getattr(hookspecs, hook), hook)}`" in TEXT, f"{hook} missing from {GUIDE.name}"


@pytest.mark.parametrize("owner,name,form", MEMBERS, ids=[f"{o}.{n}" for o, n, _ in MEMBERS])
def test_every_contract_method_is_documented_with_its_signature(owner, name, form):
    assert f"`{form}`" in TEXT, f"{owner}.{form} missing from {GUIDE.name}"


def test_the_member_list_is_not_empty():
    assert len(MEMBERS) > 30 and ("StorageBackend", "open_read", "open_read(key)") in MEMBERS


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    files = {}
    for project in (plugin_examples.STORAGE, plugin_examples.QUANTIZER):
        files[project] = plugin_examples.install(project, target, tmp_path_factory.mktemp("build"))
    return target, files


def with_site(site: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
    }


def run_python(code: str, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = with_site(site)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "project,module",
    [(plugin_examples.STORAGE, "kvcdn_storage_sqlite.py"), (plugin_examples.QUANTIZER, "kvcdn_quant_bf16.py")],
)
def test_examples_are_complete_and_short(installed, project, module):
    _, files = installed
    assert set(files[project]) == {"pyproject.toml", module}
    assert len(files[project][module].splitlines()) < 60


@pytest.mark.slow
def test_the_storage_example_passes_the_storage_contract(installed, tmp_path):
    site, _ = installed
    result = run_python(
        f"""
        import itertools, kvcdn_storage_sqlite
        from kvcdn_core.plugin_host.registry import open_storage
        from kvcdn_core.testing import assert_storage_contract

        assert kvcdn_storage_sqlite.__file__.startswith({str(site)!r}), kvcdn_storage_sqlite.__file__
        store = open_storage("sqlite://{tmp_path}/first.db")
        assert type(store).__name__ == "SqliteStorage"
        numbers = itertools.count()
        assert_storage_contract(lambda: open_storage(f"sqlite://{tmp_path}/{{next(numbers)}}.db"))
        print("contract passed")
        """,
        site,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "contract passed" in result.stdout and "warning" not in result.stderr


@pytest.mark.slow
def test_the_quantizer_example_passes_the_quantizer_contract(installed, tmp_path):
    site, _ = installed
    result = run_python(
        """
        from kvcdn_core.plugin_host.registry import quantizer_for
        from kvcdn_core.testing import assert_quantizer_contract

        cls = quantizer_for("bf16-round")
        assert cls.__module__ == "kvcdn_quant_bf16"
        assert_quantizer_contract(cls)
        print("contract passed")
        """,
        site,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "contract passed" in result.stdout


@pytest.mark.slow
def test_installed_examples_show_in_kvcdn_plugins(installed, tmp_path):
    site, _ = installed
    result = run_python("from kvcdn_core.cli.app import main; main(['plugins', '--format', 'json'])", site, tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["sqlite"]["distribution"] == "kvcdn-storage-sqlite" and rows["sqlite"]["version"] == "0.1.0"
    assert rows["sqlite"]["provides"] == {"uri_schemes": ["sqlite"]}
    assert rows["bf16"]["provides"] == {"schemes": ["bf16-round"]}
    # Installed next to the shipped plugins, the guide's examples take over none of their names.
    assert [(row["name"], row["overridden"]) for row in rows.values() if row.get("overridden")] == []


@pytest.mark.slow
def test_guide_model_family_example_installs_and_validates(tmp_path):
    site = tmp_path / "site"
    plugin_examples.install(plugin_examples.FAMILY, site, tmp_path / "build")
    contract = next(b for b in plugin_examples.fenced("python") if "assert_adapter_contract(" in b)
    (tmp_path / "test_apertus_contract.py").write_text(contract)
    env = with_site(site)
    kvcdn = [sys.executable, "-m", "kvcdn_core"]

    plugins = subprocess.run([*kvcdn, "plugins", "--format", "json"], env=env, capture_output=True, text=True)
    assert plugins.returncode == 0, plugins.stderr
    rows = json.loads(plugins.stdout)
    family = [p for p in rows if p.get("distribution") == plugin_examples.FAMILY]
    assert family and family[0]["status"] == "loaded", plugins.stdout
    assert family[0]["version"] == "0.1.0" and family[0]["provides"] == {"architectures": ["ApertusForCausalLM"]}
    # The guide's example must not take over a plugin shipped with kvcdn (nor lose to one).
    assert all(not p.get("overridden") for p in rows), [
        (p["name"], p["overridden"]) for p in rows if p.get("overridden")
    ]

    validate = subprocess.run(
        [*kvcdn, "validate", "--family", "apertus", "--format", "json"], env=env, capture_output=True, text=True
    )
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert "ApertusForCausalLM" in validate.stdout and "kvcdn-model-apertus>=0.1" in validate.stdout

    contract_run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_apertus_contract.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert contract_run.returncode == 0, contract_run.stdout[-3000:] + contract_run.stderr[-2000:]
    assert "1 passed" in contract_run.stdout


def test_guide_architectures_exist_in_transformers():
    """Every architecture the guide's examples name is a class of the installed transformers."""
    import re

    import transformers

    named = set(re.findall(r'"(\w+ForCausalLM)"', "\n".join(plugin_examples.fenced("python"))))
    assert named, "the guide names no architecture"
    for architecture in named:
        assert hasattr(transformers, architecture), f"transformers has no {architecture}"
