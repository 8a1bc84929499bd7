"""One line on the terminal while a long test runs, through pytest's output capture, so that a run
of several minutes says where it is (``pytest -q`` prints nothing else until the test ends)."""

from __future__ import annotations

import sys

import pytest


def say(request: pytest.FixtureRequest, text: str) -> None:
    """Write ``[test name] text`` on its own line to the terminal now, capture or not."""
    config = request.config
    capman = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    line = f"[{request.node.name}] {text}"
    with capman.global_and_fixture_disabled() if capman else _nothing():
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr, flush=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
