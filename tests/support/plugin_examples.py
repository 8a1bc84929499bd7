"""The example plugins of docs/plugin-guide.md, installed as their own packages (pip, no network)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugin-guide.md"
STORAGE = "A storage plugin"
QUANTIZER = "A quantizer plugin"


def section(title: str) -> str:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def example_files(title: str) -> dict[str, str]:
    """file name → content of the fenced blocks of a section that start with ``# <file name>``."""
    files = {}
    for block in re.findall(r"```(?:toml|python)\n(.*?)```", section(title), re.S):
        first, _, _ = block.partition("\n")
        if re.fullmatch(r"# [\w.-]+\.(py|toml)", first):
            files[first[2:]] = block
    return files


def install(title: str, target: Path, build: Path) -> dict[str, str]:
    """pip-install a section's example package into ``target``, a directory to put on PYTHONPATH."""
    files = example_files(title)
    build.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (build / name).write_text(content, encoding="utf-8")
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
            str(build),
        ],
        check=True,
    )
    return files
