"""Declared settings: each component lists its settings once, in a table of :class:`Setting`, and
every value is resolved the same way (flag → environment variable → config file → default) and
documented from that same table, so the docs cannot drift from what is read.

A bad value is one line naming the setting where it was given: ``--port``, ``KVCDN_GC_INTERVAL``
or ``config file PATH: 'gc_interval'``. A config file is TOML, one ``key = value`` per setting (the
key is the setting's name); an unknown key is refused, and a setting declared ``file=False`` (a
secret) is refused there too.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from kvcdn_core.errors import KvcdnError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def text(raw: Any) -> str:
    """A string, as given (stripped)."""
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {type(raw).__name__}")
    return raw.strip()


def integer(minimum: int = 0, maximum: int | None = None) -> Callable[[Any], int]:
    """A whole number, at least ``minimum`` (and at most ``maximum``)."""

    def parse(raw: Any) -> int:
        if isinstance(raw, bool):
            raise ValueError(f"must be an integer, not {raw!r}")
        if isinstance(raw, int):
            value = raw
        else:
            try:
                value = int(str(raw).strip())
            except ValueError:
                raise ValueError(f"must be an integer, not '{raw}'") from None
        if value < minimum:
            raise ValueError(f"must be at least {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"must be at most {maximum}")
        return value

    return parse


def positive_number(raw: Any) -> float:
    """A number above zero."""
    if isinstance(raw, bool):
        raise ValueError(f"must be a number, not {raw!r}")
    try:
        value = float(raw if isinstance(raw, (int, float)) else str(raw).strip())
    except ValueError:
        raise ValueError(f"must be a number, not '{raw}'") from None
    if not value > 0:
        raise ValueError("must be positive")
    return value


def choice(*values: str) -> Callable[[Any], str]:
    """One of ``values``."""

    def parse(raw: Any) -> str:
        value = text(raw)
        if value not in values:
            raise ValueError(f"must be one of {', '.join(values)}, not '{value}'")
        return value

    return parse


def boolean(raw: Any) -> bool:
    """``true``/``false`` (a TOML boolean, or the words in any case)."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ValueError(f"must be true or false, not {raw!r}")


def comma_list(raw: Any) -> list[str]:
    """``a,b,c`` (or a TOML array of strings) → ``["a", "b", "c"]``; empty items are dropped."""
    if isinstance(raw, list):
        if not all(isinstance(item, str) for item in raw):
            raise ValueError("must be a list of strings")
        items: Iterable[str] = raw
    else:
        items = text(raw).split(",")
    return [item.strip() for item in items if item.strip()]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: its name (also its config-file key), what it is for, and where it may be given.

    ``parse`` turns a raw value (a flag's value, an environment string or a TOML value) into the
    setting's value, raising :class:`ValueError` with a phrase that follows the setting's name
    (``must be an integer, not 'x'``). ``default_doc`` is how the docs show a computed default.
    """

    name: str
    help: str
    parse: Callable[[Any], Any] = text
    default: Any = None
    env: str | None = None
    flag: str | None = None
    file: bool = True
    default_doc: str | None = None


def where(setting: Setting, source: str) -> str:
    """How an error names the setting given at ``source``: ``flag``, ``env``, or the name of the
    config (``config file PATH``, or what the component calls it)."""
    if source == "flag":
        return setting.flag or setting.name
    if source == "env":
        return setting.env or setting.name
    return f"{source}: '{setting.name}'"


def _given(value: Any) -> bool:
    """An empty string in the environment or a file counts as not given (shells make it easy to
    export one); a flag is given whenever it is on the command line, even empty."""
    return value is not None and not (isinstance(value, str) and not value.strip())


def resolve(
    table: Iterable[Setting],
    flags: Mapping[str, Any] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_path: Path | str | None = None,
    environ: Mapping[str, str] | None = None,
    file_label: str | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Every setting's value and where it came from (``flag``, ``env NAME``, ``config PATH``,
    ``default``). ``flags`` are the command line's values by setting name (``None``: not given);
    ``file_label`` names the config in errors when it is no file (default ``config file PATH``)."""
    flags = flags or {}
    file_values = file_values or {}
    environ = os.environ if environ is None else environ
    settings = list(table)
    file_label = file_label or f"config file {file_path}"
    unknown = set(flags) - {s.name for s in settings}
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in settings:
        candidates = [
            (flags.get(setting.name), "flag", "flag"),
            (environ.get(setting.env) if setting.env else None, "env", f"env {setting.env}"),
            (file_values.get(setting.name), file_label, f"config {file_path}"),
        ]
        for raw, origin, label in candidates:
            if raw is not None if origin == "flag" else _given(raw):
                try:
                    values[setting.name] = setting.parse(raw)
                except ValueError as exc:
                    raise KvcdnError(f"{where(setting, origin)} {exc}") from None
                sources[setting.name] = label
                break
        else:
            values[setting.name] = copy.copy(setting.default)  # a list default is never shared
            sources[setting.name] = "default"
    return values, sources


def read_config_file(path: Path, table: Iterable[Setting], missing_ok: bool = True) -> dict[str, Any]:
    """The raw values of a TOML config file, checked against ``table``: a missing file is empty
    (when ``missing_ok``), a malformed one, an unknown key or a secret is a one-line error."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise KvcdnError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise KvcdnError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data: dict[str, Any] = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise KvcdnError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None)
        message = str(getattr(exc, "msg", "") or exc)
        if line is None:
            found = re.search(r"at line (\d+)", message)
            line = int(found.group(1)) if found else None
        message = re.sub(r"\s*\(at line \d+, column \d+\)\s*$", "", message)
        at = f" at line {line}" if line else ""
        raise KvcdnError(f"config file {path}: malformed TOML{at}: {message}") from None
    check_keys(data, table, f"config file {path}")
    return data


def check_keys(values: Mapping[str, Any], table: Iterable[Setting], label: str) -> None:
    """Refuse, in one line, a key ``table`` does not declare (naming the closest one) or a secret."""
    by_name = {s.name: s for s in table}
    for key in values:
        setting = by_name.get(key)
        if setting is None:
            close = difflib.get_close_matches(key, list(by_name), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(by_name)})"
            raise KvcdnError(f"{label}: unknown setting '{key}'{hint}")
        if not setting.file:
            instead = f"set {setting.env}" if setting.env else "pass it another way"
            raise KvcdnError(f"{label}: '{key}' is a secret and is not read from a config file; {instead}")


def markdown_table(table: Iterable[Setting]) -> str:
    """The docs' table of ``table``: one row per setting, in declaration order (without an
    environment column when no setting has a variable)."""
    rows = list(table)
    with_env = any(s.env for s in rows)
    head = ["key", *(["environment"] if with_env else []), "flag", "default", "meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        cells = [f"`{s.name}`" if s.file else f"`{s.name}` (not in a file: secret)"]
        if with_env:
            cells.append(f"`{s.env}`" if s.env else "")
        cells += [f"`{s.flag}`" if s.flag else "", _default_text(s), s.help]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _default_text(setting: Setting) -> str:
    if setting.default_doc is not None:
        return setting.default_doc
    if setting.default is None or setting.default in ([], {}):
        return "none"
    if isinstance(setting.default, bool):
        return f"`{str(setting.default).lower()}`"
    return f"`{setting.default}`"


def flag_help(setting: Setting) -> str:
    """A flag's ``--help`` text from the declaration: what it is for, its variable, its config key
    and its default, as the docs table says them (without the markdown)."""
    where = [f"env {setting.env}"] if setting.env else []
    if setting.file:
        where.append(f"config {setting.name}")
    where.append(f"default: {_default_text(setting)}")
    return f"{setting.help} [{'; '.join(where)}]".replace("`", "")


#: A generated table in a docs page: the begin marker names the table (``module.NAME``).
_BLOCK = re.compile(
    r"(<!-- settings table: (?P<table>[\w.]+) \(generated by python -m kvcdn_core\.settings; do not edit\) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- end of settings table -->)",
    re.DOTALL,
)


def table_at(dotted: str) -> tuple[Setting, ...]:
    """The table named ``module.NAME`` (e.g. ``kvcdn_server.config.SETTINGS``)."""
    import importlib

    module, _, name = dotted.rpartition(".")
    return tuple(getattr(importlib.import_module(module), name))


def render_docs(page: str) -> str:
    """``page`` with every generated settings table rewritten from its declarations."""
    return _BLOCK.sub(lambda m: m.group(1) + markdown_table(table_at(m.group("table"))) + m.group(4), page)


def tables_in(page: str) -> list[str]:
    """The tables ``page`` shows (``module.NAME`` each)."""
    return [m.group("table") for m in _BLOCK.finditer(page)]


def main(paths: list[str]) -> int:
    """Rewrite the generated settings tables of the docs pages ``paths`` in place."""
    for path in map(Path, paths):
        page = path.read_text(encoding="utf-8")
        fresh = render_docs(page)
        if fresh != page:
            path.write_text(fresh, encoding="utf-8")
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
