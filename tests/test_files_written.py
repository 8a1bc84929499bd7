"""Every file kvcdn writes outside the paths a user gives is documented (README "Files kvcdn
writes"), and the hosted examples keep keys off the command line and end curl's output with a newline."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("kvcdn_core/**/*.py"), *ROOT.glob("plugins/*/kvcdn_*/**/*.py")]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("plugins/*/README.md"))]


def section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Files kvcdn writes")
    return text[start : text.index("\n## ", start + 1)]


def test_every_per_user_cache_and_config_file_in_the_code_is_documented():
    from kvcdn_core.search.index import INDEX_NAME
    from kvcdn_core.search.prefix import PREFIX_NAME
    from kvcdn_hosted.credentials import FILE_NAME

    names = {
        INDEX_NAME,
        PREFIX_NAME,
        FILE_NAME,
        "api-key-seed",
        "admin-secret",
        "url-signing-key",
        "kvcdn.db",
        "python-entrypoints",
    }
    for path in SOURCES:
        names.update(re.findall(r'cache_home\(\) / "([^"]+)"', path.read_text(encoding="utf-8")))
    assert {"file-sha256.json", "search-index", "search-prefix"} <= names  # the scan still finds what it looks for
    documented = section()
    missing = sorted(n for n in names if n not in documented)
    assert not missing, f"written by kvcdn but not in README's 'Files kvcdn writes': {missing}"


def test_a_command_writes_only_documented_files(cli, qwen3_dir, context_file, tmp_path, monkeypatch):
    homes = {name: tmp_path / name for name in ("data", "config", "cache")}
    monkeypatch.setenv("XDG_DATA_HOME", str(homes["data"]))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(homes["config"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(homes["cache"]))
    assert cli("generate", "--model", qwen3_dir, "--context-file", context_file, "-q").exit_code == 0
    assert (
        cli("search", "--model", qwen3_dir, "--prompt", "The", "--dir", homes["data"] / "kvcdn" / "generate").exit_code
        == 0
    )
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    allowed = [
        r"data/kvcdn/generate/generate-\d+-[^/]+\.kv",
        r"data/kvcdn/generate/\.kvcdn-index",
        r"data/kvcdn/generate/\.kvcdn-prefix",
        r"cache/kvcdn/file-sha256\.json",
        r"cache/python-entrypoints/[0-9a-f]+",  # stevedore's cache of entry points
    ]
    unexpected = [w for w in written if w != "context.txt" and not any(re.fullmatch(a, w) for a in allowed)]
    assert not unexpected, unexpected
    assert any(w.startswith("cache/kvcdn/file-sha256.json") for w in written)  # the one the report found


def test_hosted_examples_pass_keys_on_stdin_and_curl_output_ends_its_line():
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{number}"
            assert not re.search(r"api-key set (\"\$\(|kv_)", line), f"{where}: a key on the command line: {line}"
            command = line.strip()
            if command.startswith("curl ") and "-sf" not in command and "/dev/null" not in command:
                assert "-w '\\n'" in command, f"{where}: curl output without a trailing newline: {line}"
