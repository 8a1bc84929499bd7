"""The example plugins of docs/plugin-guide.md, cut from the guide and installed as their own packages.

Each example file is a fenced block whose first line is a comment naming its path, project first
(``# kvcdn-storage-sqlite/pyproject.toml``). ``install`` builds the project with pip (no network, no
build isolation) into a directory the tests put on ``PYTHONPATH``: this environment's installed
plugin set never changes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugin-guide.md"
FAMILY = "kvcdn-model-apertus"
STORAGE = "kvcdn-storage-sqlite"
QUANTIZER = "kvcdn-quant-bf16"


def fenced(language: str) -> list[str]:
    """The guide's fenced blocks of ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```$", GUIDE.read_text(encoding="utf-8"), re.M | re.S)


def example_files(project: str) -> dict[str, str]:
    """Path inside the project → content, for every block of the guide that belongs to ``project``."""
    files = {}
    for block in fenced("toml") + fenced("python"):
        first = block.partition("\n")[0]
        if first.startswith(f"# {project}/"):
            files[first.removeprefix(f"# {project}/")] = block
    return files


def install(project: str, target: Path, build: Path) -> dict[str, str]:
    """pip-install the guide's ``project`` into ``target``; returns its files."""
    files = example_files(project)
    assert "pyproject.toml" in files, f"the guide has no pyproject.toml for {project}"
    for name, content in files.items():
        path = build / project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(build / project),
        ],
        check=True,
    )
    return files
