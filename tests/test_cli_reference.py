"""docs/cli.md is generated from the click definitions and must not fall out of date."""

from pathlib import Path

from kvcdn_core.clidoc import render


def test_cli_reference_is_up_to_date():
    committed = (Path(__file__).parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    assert committed == render(), "docs/cli.md is stale: run `python -m kvcdn_core.clidoc > docs/cli.md`"
