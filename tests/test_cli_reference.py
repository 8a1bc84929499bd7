"""docs/cli.md is generated from the click definitions and must not fall out of date."""

from pathlib import Path

from kvcdn_core.cli.reference import render


def test_cli_reference_is_up_to_date():
    committed = (Path(__file__).parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    assert committed == render(), "docs/cli.md is stale: run `python -m kvcdn_core.cli.reference > docs/cli.md`"


def _paths(group, prefix=()):
    import click

    for name, cmd in sorted(group.commands.items()):
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _paths(cmd, (*prefix, name))


def test_every_section_is_what_help_prints():
    """The reference is `--help` itself: every command's help, as a user's terminal of 100 columns
    shows it, stands in docs/cli.md whole (no sentinel defaults, no hidden options)."""
    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli

    committed = (Path(__file__).parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    root = make_cli()
    paths = list(_paths(root))
    assert len(paths) > 20
    for path in paths:
        result = CliRunner().invoke(root, [*path, "--help"], prog_name="kvcdn", terminal_width=100)
        assert result.exit_code == 0, (path, result.output)
        assert f"```text\n{result.stdout}```" in committed, f"kvcdn {' '.join(path)} --help differs from docs/cli.md"
    assert "Sentinel" not in committed
