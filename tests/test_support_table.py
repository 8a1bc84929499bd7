"""The README's support table lists exactly the architectures the installed adapters claim.

Regenerate it with ``kvcdn validate --format markdown`` and paste the output between the
``support-table`` markers in README.md.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- support-table:start -->", "<!-- support-table:end -->"
REGENERATE = "regenerate with `kvcdn validate --format markdown` and paste it between the markers"


def table_rows(text: str) -> set[tuple[str, str, str]]:
    """(architecture, family, extra) for each body row of a support table."""
    rows = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] in ("Architecture", "---"):
            continue
        extra = re.search(r"kvcdn\[([^\]]+)\]", cells[2])
        rows.add((cells[0].strip("`"), cells[1], extra.group(1) if extra else cells[2]))
    return rows


def readme_table() -> str:
    text = README.read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, f"README.md needs one {START} ... {END} block"
    return text.split(START, 1)[1].split(END, 1)[0]


def installed_rows(host) -> set[tuple[str, str, str]]:
    return {(arch, cls.family, cls.extra_name()) for arch, cls in host.model_adapters().items()}


def test_readme_lists_exactly_the_installed_architectures(discovered_host):
    listed, installed = table_rows(readme_table()), installed_rows(discovered_host)
    missing, stale = sorted(installed - listed), sorted(listed - installed)
    assert not missing and not stale, (
        f"README support table is out of date; missing: {missing}; not installed: {stale}; {REGENERATE}"
    )


def test_generated_table_parses_back(discovered_host):
    """What `kvcdn validate --format markdown` prints is what this test reads."""
    from kvcdn_core.cli.commands.validate import ArchReport, render_markdown

    reports = [
        ArchReport(cls.family, cls.install_requirement(), arch, "tiny")
        for arch, cls in discovered_host.model_adapters().items()
    ]
    assert table_rows(render_markdown(reports)) == installed_rows(discovered_host)


def test_a_third_party_family_names_its_own_pip_requirement():
    from kvcdn_core import ModelAdapter
    from kvcdn_core.cli.commands.validate import ArchReport, render_markdown

    class Olmo3Adapter(ModelAdapter):
        family = "olmo3"
        architectures = ("Olmo3ForCausalLM",)
        requirement = "kvcdn-model-olmo3>=0.2"

    text = render_markdown([ArchReport("olmo3", Olmo3Adapter.install_requirement(), "Olmo3ForCausalLM", "tiny")])
    assert "`pip install 'kvcdn-model-olmo3>=0.2'`" in text and "kvcdn[olmo3]" not in text
