"""Declared settings (kvcdn_core.settings): one resolution order, one-line errors naming where a
value came from, config files that refuse unknown keys and secrets, and docs tables generated from
the declarations (a page whose table differs from its declarations fails here)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from kvcdn_core import KvcdnError, settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

TABLE = (
    settings.Setting("name", "A name.", default="anon", env="T_NAME", flag="--name"),
    settings.Setting("count", "How many.", settings.integer(1, 10), 3, env="T_COUNT", flag="--count"),
    settings.Setting("ratio", "A ratio.", settings.positive_number, 0.5, env="T_RATIO"),
    settings.Setting("hosts", "Hosts.", settings.comma_list, [], env="T_HOSTS", flag="--hosts"),
    settings.Setting("on", "Switch.", settings.boolean, False),
    settings.Setting("token", "A secret.", env="T_TOKEN", file=False),
)


def test_flag_beats_env_beats_file_beats_default():
    file_values = {"name": "file", "count": 5, "ratio": "0.25"}
    env = {"T_NAME": "env", "T_COUNT": "7"}
    values, sources = settings.resolve(TABLE, {"name": "flag"}, file_values, "/etc/t.toml", env)
    assert (values["name"], sources["name"]) == ("flag", "flag")
    assert (values["count"], sources["count"]) == (7, "env T_COUNT")
    assert (values["ratio"], sources["ratio"]) == (0.25, "config /etc/t.toml")
    assert (values["hosts"], sources["hosts"]) == ([], "default")
    values, _ = settings.resolve(TABLE, {}, file_values, "/etc/t.toml", {})
    assert values["name"] == "file" and values["count"] == 5


def test_empty_env_and_file_are_unset_but_an_empty_flag_is_given():
    values, sources = settings.resolve(TABLE, {}, {"name": ""}, "f", {"T_NAME": " ", "T_HOSTS": ""})
    assert values["name"] == "anon" and sources["hosts"] == "default"
    values, sources = settings.resolve(TABLE, {"hosts": ""}, {}, "f", {"T_HOSTS": "a,b"})
    assert values["hosts"] == [] and sources["hosts"] == "flag"


def test_a_default_list_is_never_shared():
    first, _ = settings.resolve(TABLE, environ={})
    first["hosts"].append("x")
    assert settings.resolve(TABLE, environ={})[0]["hosts"] == []


@pytest.mark.parametrize(
    "flags,env,file_values,message",
    [
        ({"count": "many"}, {}, {}, "--count must be an integer, not 'many'"),
        ({}, {"T_COUNT": "0"}, {}, "T_COUNT must be at least 1"),
        ({}, {"T_COUNT": "11"}, {}, "T_COUNT must be at most 10"),
        ({}, {}, {"count": True}, "config file /t.toml: 'count' must be an integer, not True"),
        ({}, {"T_RATIO": "-1"}, {}, "T_RATIO must be positive"),
        ({}, {}, {"ratio": "half"}, "config file /t.toml: 'ratio' must be a number, not 'half'"),
        ({}, {}, {"on": "yes"}, "config file /t.toml: 'on' must be true or false, not 'yes'"),
        ({}, {}, {"name": 3}, "config file /t.toml: 'name' must be a string, got int"),
        ({}, {}, {"hosts": [1]}, "config file /t.toml: 'hosts' must be a list of strings"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_setting_where_it_was_given(flags, env, file_values, message):
    with pytest.raises(KvcdnError) as err:
        settings.resolve(TABLE, flags, file_values, "/t.toml", env)
    assert str(err.value) == message and err.value.exit_code == 2


def test_config_file_refuses_unknown_keys_secrets_and_bad_toml(tmp_path):
    path = tmp_path / "t.toml"
    assert settings.read_config_file(path, TABLE) == {}
    with pytest.raises(KvcdnError, match="does not exist"):
        settings.read_config_file(path, TABLE, missing_ok=False)
    path.write_text('name = "x"\nhosts = ["a", "b"]\n')
    assert settings.read_config_file(path, TABLE) == {"name": "x", "hosts": ["a", "b"]}
    for text, message in (
        ('nmae = "x"\n', f"config file {path}: unknown setting 'nmae' (did you mean 'name'?)"),
        ('zzz = "x"\n', f"config file {path}: unknown setting 'zzz' (known: name, count, ratio, hosts, on, token)"),
        (
            'token = "abc"\n',
            f"config file {path}: 'token' is a secret and is not read from a config file; set T_TOKEN",
        ),
        ('name = "x"\ncount = \n', f"config file {path}: malformed TOML at line 2: "),
    ):
        path.write_text(text)
        with pytest.raises(KvcdnError) as err:
            settings.read_config_file(path, TABLE)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _tables() -> dict[str, tuple[settings.Setting, ...]]:
    return {
        name: settings.table_at(name)
        for name in ("kvcdn_server.config.SETTINGS", "kvcdn_hosted.config.SETTINGS", "kvcdn_vllm.settings.SETTINGS")
    }


def test_every_setting_has_help_and_a_unique_name():
    for name, table in _tables().items():
        names = [s.name for s in table]
        assert len(names) == len(set(names)), name
        for s in table:
            assert s.help.strip().endswith((".", ")")) and "|" not in s.help, (name, s.name)


def test_a_config_key_is_its_variable_without_the_prefix():
    for name in ("kvcdn_server.config.SETTINGS", "kvcdn_hosted.config.SETTINGS"):
        for s in settings.table_at(name):
            assert s.env in (None, f"KVCDN_{s.name.upper()}"), (name, s.name)


def test_each_table_is_shown_in_its_page_as_declared():
    """The docs' tables are generated: `python -m kvcdn_core.settings docs/*.md` rewrites them."""
    expected = {
        "docs/deployment.md": ["kvcdn_server.config.SETTINGS"],
        "docs/hosted-client.md": ["kvcdn_hosted.config.SETTINGS"],
        "docs/vllm.md": ["kvcdn_vllm.settings.SETTINGS"],
    }
    shown = {}
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        if settings.tables_in(text):
            shown[page.relative_to(ROOT).as_posix()] = settings.tables_in(text)
        assert settings.render_docs(text) == text, (
            f"{page.relative_to(ROOT)}: a settings table differs from its declarations; "
            "run `python -m kvcdn_core.settings docs/*.md`"
        )
    assert shown == expected


def test_the_docs_check_catches_a_stale_table():
    page = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    stale = page.replace("| `min_tokens` | `--min-tokens` | one vLLM block |", "| `min_tokens` | `--min-tokens` | 16 |")
    assert stale != page and settings.render_docs(stale) == page


def _options(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in getattr(param, "opts", [])}


def test_every_declared_flag_is_an_option_of_its_command():
    from kvcdn_vllm.serve import command as vllm_serve

    from kvcdn_hosted import commands
    from kvcdn_server.command import serve

    assert {s.flag for s in settings.table_at("kvcdn_server.config.SETTINGS") if s.flag} <= _options(serve)
    assert {s.flag for s in settings.table_at("kvcdn_vllm.settings.SETTINGS")} <= _options(vllm_serve)
    hosted = set().union(
        *(
            _options(c)
            for c in vars(commands).values()
            if isinstance(c, click.Command) and not isinstance(c, click.Group)
        )
    )
    assert {s.flag for s in settings.table_at("kvcdn_hosted.config.SETTINGS") if s.flag} <= hosted


def test_serve_help_is_the_table():
    from kvcdn_server.command import serve

    helps = {opt: param.help for param in serve.params for opt in getattr(param, "opts", [])}
    for s in settings.table_at("kvcdn_server.config.SETTINGS"):
        if s.flag:
            assert helps[s.flag] == settings.flag_help(s), s.flag
    port = next(s for s in settings.table_at("kvcdn_server.config.SETTINGS") if s.name == "port")
    assert settings.flag_help(port) == "TCP port to listen on (0: any free port). [config port; default: 8080]"
