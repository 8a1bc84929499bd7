"""Start-up stays light: commands that need no model never import torch or transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.budget import budget

PROBE = """
import sys
from kvcdn_core.cli.app import main
try:
    main({args!r})
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "safetensors.torch", "numpy") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["plugins"],
        ["plugins", "--format", "json"],
        ["inspect", "ARTIFACT"],
        ["inspect", "ARTIFACT", "--check"],
        ["verify", "--help"],
        ["generate", "--help"],
        ["store", "--help"],
        ["store", "ls", "--store", "STORE"],
        ["store", "check", "--store", "STORE"],
    ],
)
def test_light_commands_do_not_import_torch(args, qwen3_artifact):
    store = str(qwen3_artifact.parent / "no-store-here")
    args = [str(qwen3_artifact) if a == "ARTIFACT" else store if a == "STORE" else a for a in args]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, timeout=budget(120)
    )
    heavy = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY=")]
    assert heavy == ["HEAVY="], proc.stderr


def test_version_output():
    import kvcdn_core

    proc = subprocess.run([sys.executable, "-m", "kvcdn_core", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kvcdn, version {kvcdn_core.__version__}"


def test_inspect_json_is_machine_readable(qwen3_artifact):
    proc = subprocess.run(
        [sys.executable, "-m", "kvcdn_core", "inspect", str(qwen3_artifact), "--format", "json"],
        capture_output=True,
        text=True,
    )
    data = json.loads(proc.stdout)
    assert data["manifest"]["model"]["architecture"] == "Qwen3ForCausalLM"
