"""Shared fixtures for core and cross-plugin tests (the kvcdn pytest plugin adds more)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests.support helpers, whatever the runner
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


#: Tests under these directories start hosted services (kvcdn serve, the OIDC issuer, moto's S3
#: server): marked `hosted`, so that `scripts/test.sh -m "not slow and not hosted"` leaves them out.
HOSTED_TEST_DIRS = ("tests/hosted", "plugins/kvcdn-storage-s3/tests")


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        where = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if where.startswith(tuple(d + "/" for d in HOSTED_TEST_DIRS)):
            item.add_marker(pytest.mark.hosted)


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    """Every test gets its own XDG data and config directories."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model):
    from kvcdn_model_qwen import QwenAdapter

    return tiny_model(QwenAdapter, "Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model):
    from kvcdn_model_qwen import QwenAdapter

    return tiny_model(QwenAdapter, "Qwen2ForCausalLM")


@pytest.fixture
def progress(request):
    """``progress(text)``: a line on the terminal now, through output capture (long tests say where they are)."""
    from tests.support.progress import say

    return lambda text: say(request, text)


@pytest.fixture
def context_file(tmp_path):
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    path = tmp_path / "context.txt"
    path.write_text(SAMPLE_TEXT, encoding="utf-8")
    return path


@pytest.fixture
def run_kvcdn():
    """Run the real ``kvcdn`` console entry in a subprocess: ``(returncode, stdout, stderr)``."""

    from tests.support.budget import budget

    def run(*args, env=None, check=None):
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.run(
            [sys.executable, "-m", "kvcdn_core", *map(str, args)],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=budget(300),
        )
        if check is not None:
            assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
        return proc.returncode, proc.stdout, proc.stderr

    return run


@pytest.fixture
def cli():
    """Invoke kvcdn in-process (fast): ``cli(*args) -> click Result`` with separate stderr."""
    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli

    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(make_cli(), [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture(scope="session")
def qwen3_artifact(qwen3_dir, tmp_path_factory):
    """A generated artifact of the tiny Qwen3 model over the sample text."""
    from kvcdn_core import runtime
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    session = runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")
    path = tmp_path_factory.mktemp("art") / "sample.kv"
    runtime.generate(session, SAMPLE_TEXT, path, chunk=100, progress=False)
    return path
