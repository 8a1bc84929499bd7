"""Library code never writes to stderr or stdout; commands render (kvcdn_core/cli/render.py).

Outside the command layer a module reports through return values, :mod:`kvcdn_core.notices`
(warnings and notes, which are Python warnings) and :mod:`kvcdn_core.progress` events. Read from the
source (AST): ``print``, ``sys.stdout``/``sys.stderr``, ``click.echo``/``secho``/``confirm``/
``prompt`` and ``traceback.print_*`` are allowed only in the command layer, and in a script's own
entry point (``if __name__ == "__main__":`` and the ``main`` function it runs).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The command layer: the CLI, the one renderer, core's commands and each plugin's command module.
COMMAND_LAYER = (
    "kvcdn_core/cli/app.py",
    "kvcdn_core/cli/render.py",
    "kvcdn_core/cli/commands/",
    "plugins/kvcdn-hosted/kvcdn_hosted/commands.py",
    "plugins/kvcdn-server/kvcdn_server/command.py",
    "plugins/kvcdn-vllm/kvcdn_vllm/serve.py",
)
WRITERS = {("click", "echo"), ("click", "secho"), ("click", "confirm"), ("click", "prompt")}


def library_modules() -> list[Path]:
    found = list((ROOT / "kvcdn_core").rglob("*.py"))
    for plugin in (ROOT / "plugins").iterdir():
        found += [p for p in plugin.rglob("*.py") if "tests" not in p.relative_to(plugin).parts]
    return sorted(p for p in found if not p.relative_to(ROOT).as_posix().startswith(COMMAND_LAYER))


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def writes(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, what)`` of every terminal write outside the module's script entry point."""
    script = any(_is_main_guard(node) for node in tree.body)
    allowed: set[int] = set()
    for node in tree.body:
        if _is_main_guard(node) or (script and isinstance(node, ast.FunctionDef) and node.name == "main"):
            allowed.update(id(inner) for inner in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        what = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            what = "print()"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            pair = (node.value.id, node.attr)
            if pair in {("sys", "stdout"), ("sys", "stderr"), ("sys", "__stdout__"), ("sys", "__stderr__")}:
                what = f"{node.value.id}.{node.attr}"
            elif pair in WRITERS or (node.value.id == "traceback" and node.attr.startswith("print_")):
                what = f"{node.value.id}.{node.attr}()"
        if what:
            found.append((node.lineno, what))
    return sorted(found)


def test_library_modules_do_not_write_to_the_terminal():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in library_modules()
        for line, what in writes(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not offenders, "library code writes to the terminal (report through kvcdn_core.notices):\n" + "\n".join(
        offenders
    )


def test_the_check_finds_a_write():
    """The check is not vacuous: each kind of write is found, a script's own main is not."""
    source = (
        "import sys, click, traceback\n"
        "def f():\n    print('x')\n    sys.stderr.write('y')\n    click.echo('z', err=True)\n"
        "    traceback.print_exc()\n"
        "def main():\n    print('ok')\n"
        "if __name__ == '__main__':\n    sys.stdout.write('ok')\n"
    )
    assert [what for _, what in writes(ast.parse(source))] == [
        "print()",
        "sys.stderr",
        "click.echo()",
        "traceback.print_exc()",
    ]
    modules = library_modules()
    assert (
        len(modules) > 50
        and ROOT / "kvcdn_core/runtime.py" in modules
        and ROOT / "kvcdn_core/cli/app.py" not in modules
    )


def test_library_warnings_are_python_warnings_and_the_cli_shows_them_as_before(tmp_path):
    """The same warning: a ``KvcdnWarning`` to a program, ``warning: <message>`` from the CLI."""
    from kvcdn_core import KvcdnWarning, ensure_kv_suffix

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ensure_kv_suffix(tmp_path / "out") == tmp_path / "out.kv"
    assert [(w.category, str(w.message)) for w in seen] == [
        (KvcdnWarning, f"KV artifact path '{tmp_path / 'out'}' does not end with '.kv'; appending '.kv'")
    ]
    code = (
        "import sys; from kvcdn_core import ensure_kv_suffix\n"
        "from kvcdn_core.cli.render import reporting\n"
        "with reporting():\n    ensure_kv_suffix(sys.argv[1])\n"
    )
    shown = subprocess.run([sys.executable, "-c", code, "x"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout == ""
    assert shown.stderr == "warning: KV artifact path 'x' does not end with '.kv'; appending '.kv'\n"


def test_progress_is_events_drawn_only_by_the_renderer():
    from kvcdn_core import progress

    seen: list[progress.ProgressEvent] = []
    with progress.listening(seen.append), progress.Progress(10, "work", unit="bytes") as bar:
        bar.update(4)
        bar.update(6)
    assert [(e.done, e.total, e.finished) for e in seen] == [(4, 10, False), (10, 10, False), (10, 10, True)]
    with progress.listening(seen.append), progress.Progress(10, "quiet", enabled=False) as bar:
        bar.update(10)
    assert len(seen) == 3, "a disabled Progress (--quiet) reported"


@pytest.mark.parametrize("tty", [True, False])
def test_the_bar_is_drawn_only_on_a_terminal(tty, monkeypatch, capsys):
    from kvcdn_core import progress
    from kvcdn_core.cli.render import reporting

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    with reporting(), progress.Progress(2, "sha256", unit="bytes") as bar:
        bar.update(2)
    err = capsys.readouterr().err
    if tty:
        assert err.startswith("\rsha256 [##############################] 2 B/2 B 100% ") and err.endswith("\n")
    else:
        assert err == ""


def test_nested_reporting_draws_one_bar_and_shows_each_warning_once(monkeypatch, capsys):
    """``kvcdn``'s entry point and its command group both report: the inner block adds nothing."""
    from kvcdn_core import progress
    from kvcdn_core.cli.render import reporting
    from kvcdn_core.notices import warn

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with reporting(), reporting():
        with progress.Progress(2, "sha256", unit="bytes") as bar:
            bar.update(2)
        warn("once")
    err = capsys.readouterr().err
    assert err.count("\rsha256 [") == 1 and err.count("warning: once") == 1
    assert err.count("\n") == 2  # one for the finished bar, one for the warning


def test_warnings_go_through_core_warn():
    """A command warns with ``warn`` (kvcdn_core.notices), never by echoing ``warning: ...`` itself:
    one place words and routes every warning (stderr in a command, Python warnings in a program)."""
    shown_by = ROOT / "kvcdn_core" / "cli" / "render.py"  # where a KvcdnWarning becomes ``warning: <message>``
    echoed = []
    for path in [*(ROOT / "kvcdn_core").rglob("*.py"), *ROOT.glob("plugins/*/kvcdn_*/**/*.py")]:
        if path == shown_by:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("warning: "):
                echoed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert echoed == []
