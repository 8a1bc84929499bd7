"""Every ```bash block of README.md and docs/*.md runs as pasted.

Per file, the blocks run in order in one bash process (as if pasted into one terminal, but stopping
at the first failing line) inside a fresh copy of the checkout in a temporary directory, with an
empty home, the Hugging Face hub offline and this checkout's ``kvcdn`` first on PATH. A block whose
fence is directly preceded by ``<!-- docs-test: skip (reason) -->`` is not run; the skipped blocks
and their reasons are printed. A block that leaves a background process running fails the test.

Each block has its own time limit, :data:`BLOCK_S` on an idle core scaled by the machine's measured
slowdown (``tests/support/budget.py``), and says on the terminal when it starts, so that a long run
(``kvcdn validate`` takes minutes on a busy machine) is never silent.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.budget import budget

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^<!-- docs-test: skip \((?P<reason>[^)]+)\) -->$")
#: the longest any one block may take on an idle core (the README's `kvcdn validate` takes about 5 min)
BLOCK_S = 600
MARK = re.compile(r"### docs-test: (\S+) at (\S+)")


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    text: str
    skip_reason: str | None


def bash_blocks(path: Path) -> list[Block]:
    """The ```bash blocks of a Markdown file, with the skip reason written above each, if any."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start, body = i, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            above = lines[start - 1].strip() if start else ""
            match = SKIP.match(above)
            blocks.append(Block(start + 1, "\n".join(body) + "\n", match["reason"] if match else None))
        i += 1
    return blocks


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked and untracked-but-not-ignored files, as a fresh clone would have them."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def script_for(path: Path, blocks: list[Block]) -> str:
    parts = ["set -eo pipefail"]
    for block in blocks:
        if block.skip_reason is None:
            parts.append(f'echo "### docs-test: {path.name}:{block.line} at $(date +%s.%N)" >&2')
            parts.append(block.text)
    # Whatever a block started, it must also stop (a few seconds' grace for a graceful shutdown).
    parts.append('for _ in $(seq 50); do [ -z "$(jobs -pr)" ] && break; sleep 0.2; done')
    parts.append(
        'left=$(jobs -pr); if [ -n "$left" ]; then '
        'echo "### docs-test: still running at the end: pids $left" >&2; kill $left; exit 97; fi'
    )
    return "\n".join(parts) + "\n"


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCDN_", "XDG_", "HF_", "PYTEST_", "COV_"))}
    env.update(
        HOME=str(home),
        HF_HUB_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    return env


def documented_files() -> list[Path]:
    return [p for p in DOC_FILES if bash_blocks(p)]


class BlockWatch:
    """Kills the examples' process group when the block being run exceeds its budget."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.block, self.limit, self.expired = process, "(start)", budget(BLOCK_S), False
        self.deadline = time.monotonic() + self.limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def next_block(self, where: str) -> None:
        self.block, self.limit = where, budget(BLOCK_S)
        self.deadline = time.monotonic() + self.limit

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() > self.deadline:
                self.expired = True
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
@pytest.mark.hosted
@pytest.mark.parametrize("doc", documented_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_examples_run_as_pasted(doc, tmp_path, capsys):
    blocks = bash_blocks(doc)
    recursive = [b.line for b in blocks if b.skip_reason is None and "scripts/test.sh" in b.text]
    assert not recursive, f"{doc.name}: blocks at lines {recursive} run the test suite itself: mark them skipped"
    with capsys.disabled():
        for block in blocks:
            if block.skip_reason is not None:
                print(f"\n[docs-test] {doc.relative_to(ROOT)}:{block.line} not run: {block.skip_reason}")
    checkout, home = tmp_path / "checkout", tmp_path / "home"
    checkout.mkdir()
    home.mkdir()
    copy_checkout(checkout)
    started = time.monotonic()
    process = subprocess.Popen(
        ["bash", "-c", script_for(doc, blocks)],
        cwd=checkout,
        env=clean_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    watch = BlockWatch(process)
    lines: list[str] = []
    try:
        with capsys.disabled():
            for line in process.stdout:
                lines.append(line)
                mark = MARK.match(line)
                if mark:  # a block starts: its own budget, and a line on the terminal
                    watch.next_block(mark[1])
                    print(f"\n[docs-test] running {mark[1]} (budget {watch.limit:.0f}s)", end="", flush=True)
        process.wait()
    finally:
        watch.stop()
        try:  # nothing the examples started may outlive them
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = "".join(lines)
    if watch.expired:
        pytest.fail(f"the block at {watch.block} ran over its budget of {watch.limit:.0f}s:\n{output[-4000:]}")
    marks = re.findall(r"### docs-test: (\S+) at (\S+)", output)
    ends = [float(t) for _, t in marks[1:]] + [time.time()]
    with capsys.disabled():
        spent = ", ".join(f"{where.split(':')[1]}: {end - float(t):.1f}s" for (where, t), end in zip(marks, ends))
        print(f"\n[docs-test] {doc.relative_to(ROOT)}: {time.monotonic() - started:.1f}s (block at line: {spent})")
    if process.returncode != 0:
        where = marks[-1][0] if marks else doc.name
        pytest.fail(f"the block at {where} failed (exit {process.returncode}):\n{output[-6000:]}")


def test_block_extraction_and_skip_marker(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n```bash\necho one\n```\n<!-- docs-test: skip (needs a GPU) -->\n```bash\necho two\n"
        "```\n```text\nnot run\n```\n```bash\necho three\n```\n",
        encoding="utf-8",
    )
    blocks = bash_blocks(doc)
    assert [(b.line, b.text, b.skip_reason) for b in blocks] == [
        (2, "echo one\n", None),
        (6, "echo two\n", "needs a GPU"),
        (12, "echo three\n", None),
    ]
    script = script_for(doc, blocks)
    assert "echo one" in script and "echo three" in script and "echo two" not in script


def test_every_skip_marker_sits_on_a_bash_block():
    """A marker above anything else (a typo, a moved block) would silently skip nothing or the wrong block."""
    for doc in DOC_FILES:
        lines = doc.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if "docs-test:" in line:
                assert SKIP.match(line.strip()), f"{doc.name}:{i + 1}: malformed marker {line!r}"
                assert i + 1 < len(lines) and lines[i + 1].strip() == "```bash", (
                    f"{doc.name}:{i + 1}: the skip marker is not directly above a ```bash fence"
                )
