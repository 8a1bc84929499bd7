"""The plugin guide's model-family example installs and works, from the guide's own text.

The pyproject and module are cut from docs/plugin-guide.md, built and installed with pip into a
scratch directory (not this environment: the installed plugin set must not change for other tests),
then `kvcdn plugins`, `kvcdn validate --family helium` and the guide's contract test run with that
directory on the path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugin-guide.md"


def fenced(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", GUIDE.read_text(encoding="utf-8"), re.M | re.S)


def guide_file(language: str, first_line: str) -> str:
    """The block of ``language`` whose first line is the comment ``first_line`` (its path)."""
    found = [b for b in fenced(language) if b.splitlines()[0] == first_line]
    assert len(found) == 1, f"the guide has no single {language} block starting {first_line!r}"
    return found[0]


@pytest.mark.slow
def test_guide_model_family_example_installs_and_validates(tmp_path):
    project = tmp_path / "kvcdn-model-helium"
    (project / "kvcdn_model_helium").mkdir(parents=True)
    (project / "pyproject.toml").write_text(guide_file("toml", "# kvcdn-model-helium/pyproject.toml"))
    (project / "kvcdn_model_helium" / "__init__.py").write_text(
        guide_file("python", "# kvcdn-model-helium/kvcdn_model_helium/__init__.py"))
    contract = next(b for b in fenced("python") if "assert_adapter_contract(" in b)
    (tmp_path / "test_helium_contract.py").write_text(contract)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(project)], check=True, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    kvcdn = [sys.executable, "-m", "kvcdn_core"]

    plugins = subprocess.run([*kvcdn, "plugins", "--format", "json"], env=env, capture_output=True, text=True)
    assert plugins.returncode == 0, plugins.stderr
    helium = [p for p in json.loads(plugins.stdout) if p.get("distribution") == "kvcdn-model-helium"]
    assert helium and helium[0]["status"] == "loaded", plugins.stdout
    assert helium[0]["version"] == "0.1.0"

    validate = subprocess.run([*kvcdn, "validate", "--family", "helium", "--format", "json"], env=env,
                              capture_output=True, text=True)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert "HeliumForCausalLM" in validate.stdout

    contract_run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   str(tmp_path / "test_helium_contract.py")], cwd=tmp_path, env=env,
                                  capture_output=True, text=True)
    assert contract_run.returncode == 0, contract_run.stdout[-3000:] + contract_run.stderr[-2000:]
    assert "1 passed" in contract_run.stdout


def test_guide_architectures_exist_in_transformers():
    """Every architecture the guide's examples name is a class of the installed transformers."""
    import transformers

    named = set(re.findall(r'"(\w+ForCausalLM)"', "\n".join(fenced("python"))))
    assert named, "the guide names no architecture"
    for architecture in named:
        assert hasattr(transformers, architecture), f"transformers has no {architecture}"
