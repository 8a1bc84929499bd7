"""The plugin host: discovery, failure isolation, blocking, in-process registration."""

from __future__ import annotations

import json
import textwrap
import types

import pytest

import kvcdn_core
from kvcdn_core.plugin_host.manager import PluginHost


def _fake_distribution(root, name, group, module, source):
    """A real installed distribution on disk: a module and a dist-info with entry_points.txt."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name.replace('-', '_')}-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {module}\n")
    return root


@pytest.fixture
def plugin_dir(tmp_path):
    root = tmp_path / "site"
    root.mkdir()
    _fake_distribution(
        root, "broken-plugin", "kvcdn.models", "broken_plugin_mod", "import a_module_that_does_not_exist\n"
    )
    _fake_distribution(
        root,
        "odd-plugin",
        "kvcdn.commands",
        "odd_plugin_mod",
        """
        from kvcdn_core import hookimpl

        @hookimpl
        def kvcdn_register_gadgets():
            return []
        """,
    )
    _fake_distribution(
        root,
        "hello-plugin",
        "kvcdn.commands",
        "hello_plugin_mod",
        """
        import click
        from kvcdn_core import hookimpl

        @click.command("hello")
        def hello():
            click.echo("hello from a plugin")

        @hookimpl
        def kvcdn_register_commands(cli):
            cli.add_command(hello)
        """,
    )
    return root


def test_broken_and_unknown_hook_plugins_are_skipped_and_reported(plugin_dir, run_kvcdn):
    env = {"PYTHONPATH": str(plugin_dir)}
    code, out, err = run_kvcdn("hello", env=env)
    assert code == 0 and out.strip() == "hello from a plugin"
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, err
    assert "plugin 'broken-plugin' (kvcdn.models) failed to load" in err
    assert "ModuleNotFoundError" in err and "Traceback" not in err
    assert "plugin 'odd-plugin' (kvcdn.commands) implements an unknown hook" in err
    assert "kvcdn_register_gadgets" in err

    code, out, _ = run_kvcdn("plugins", "--format", "json", env=env)
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0
    assert rows["broken-plugin"]["status"] == "failed"
    assert rows["broken-plugin"]["distribution"] == "broken-plugin"
    assert rows["broken-plugin"]["version"] == "0.3.0"
    assert rows["hello-plugin"]["status"] == "loaded"
    assert rows["hello-plugin"]["hooks"] == ["kvcdn_register_commands"]
    assert rows["qwen"]["groups"] == ["kvcdn.models"]
    assert rows["core"]["status"] == "loaded"


def test_debug_shows_the_traceback(plugin_dir, run_kvcdn):
    _, _, err = run_kvcdn("plugins", env={"PYTHONPATH": str(plugin_dir), "KVCDN_DEBUG": "1"})
    assert "Traceback" in err and "a_module_that_does_not_exist" in err


def test_disabled_plugins_are_blocked(plugin_dir, run_kvcdn):
    env = {"PYTHONPATH": str(plugin_dir), "KVCDN_DISABLE_PLUGINS": "broken-plugin,hello-plugin"}
    code, out, err = run_kvcdn("plugins", "--format", "json", env=env)
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["broken-plugin"]["status"] == "blocked"
    assert rows["hello-plugin"]["status"] == "blocked"
    assert "broken-plugin" not in err
    code, _, err = run_kvcdn("hello", env=env)
    assert code == 2 and "No such command 'hello'" in err


def test_plugins_table(run_kvcdn):
    code, out, _ = run_kvcdn("plugins")
    assert code == 0
    assert out.splitlines()[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "GROUPS", "HOOKS", "STATUS"]
    assert any(line.split()[0] == "qwen" and line.split()[-1] == "loaded" for line in out.splitlines()[1:])


def test_in_process_registration_and_last_adapter_wins(kvcdn_host):
    from kvcdn_core import ModelAdapter
    from kvcdn_core.plugin_host.registry import adapter_for

    class ToyAdapter(ModelAdapter):
        family = "toy"
        architectures = ("ToyForCausalLM",)

    plugin = types.SimpleNamespace(kvcdn_register_model_adapters=kvcdn_core.hookimpl(lambda: [ToyAdapter]))
    kvcdn_host.register(plugin, "toy", "kvcdn.models")
    assert adapter_for("ToyForCausalLM") is ToyAdapter
    assert kvcdn_host.infos["toy"].hooks == ["kvcdn_register_model_adapters"]


def warned(records) -> str:
    """The kvcdn warnings a test recorded, one per line."""
    return "\n".join(str(w.message) for w in records if issubclass(w.category, kvcdn_core.KvcdnWarning))


def test_a_plugin_raising_in_a_hook_is_isolated(kvcdn_host, recwarn):
    def bad():
        raise RuntimeError("boom")

    plugin = types.SimpleNamespace(kvcdn_register_model_adapters=kvcdn_core.hookimpl(bad))
    kvcdn_host.register(plugin, "bad", "kvcdn.models")
    assert kvcdn_host.model_adapters() == {}
    assert kvcdn_host.infos["bad"].status == "failed"
    assert "raised in kvcdn_register_model_adapters" in warned(recwarn)
    assert kvcdn_host.storage_backends()["file"].__name__ == "LocalStorage"


def test_unclaimed_architecture_names_the_extra(kvcdn_host):
    from kvcdn_core.errors import KvcdnError
    from kvcdn_core.plugin_host.registry import adapter_for

    with pytest.raises(KvcdnError, match=r"pip install 'kvcdn\[gemma\]'"):
        adapter_for("Gemma2ForCausalLM")


def test_builtin_parts_register_through_the_hooks():
    host = PluginHost(discover=False)
    assert host.storage_backends()["file"].__name__ == "LocalStorage"
    assert host.infos["core"].hooks == ["kvcdn_register_commands"]


@pytest.mark.parametrize("result", [[object()], "not a list", [type("NoArch", (), {})]])
def test_a_plugin_returning_garbage_is_isolated(kvcdn_host, recwarn, result):
    from kvcdn_model_qwen import QwenAdapter

    good = types.SimpleNamespace(kvcdn_register_model_adapters=kvcdn_core.hookimpl(lambda: [QwenAdapter]))
    bad = types.SimpleNamespace(kvcdn_register_model_adapters=kvcdn_core.hookimpl(lambda: result))
    kvcdn_host.register(good, "good", "kvcdn.models")
    kvcdn_host.register(bad, "bad", "kvcdn.models")
    assert kvcdn_host.model_adapters()["Qwen3ForCausalLM"] is QwenAdapter
    assert kvcdn_host.infos["bad"].status == "failed"
    assert "invalid result" in warned(recwarn)


def test_duplicate_claims_follow_the_precedence_and_are_reported(kvcdn_host, recwarn):
    from kvcdn_core import LocalStorage, ModelAdapter
    from kvcdn_core.plugin_host.registry import adapter_for, open_storage

    class First(ModelAdapter):
        family = "first"
        architectures = ("DupForCausalLM",)

    class Second(ModelAdapter):
        family = "second"
        architectures = ("DupForCausalLM", "OnlySecondForCausalLM")

    class Hijack(LocalStorage):
        schemes = ("file",)

    # Registered in the "wrong" order: precedence is by name, not by registration.
    kvcdn_host.register(
        types.SimpleNamespace(kvcdn_register_model_adapters=kvcdn_core.hookimpl(lambda: [Second])),
        "zeta",
        "kvcdn.models",
    )
    kvcdn_host.register(
        types.SimpleNamespace(kvcdn_register_model_adapters=kvcdn_core.hookimpl(lambda: [First])),
        "alpha",
        "kvcdn.models",
    )
    kvcdn_host.register(
        types.SimpleNamespace(kvcdn_register_storage_backends=kvcdn_core.hookimpl(lambda: [Hijack])),
        "aaa-storage",
        "kvcdn.storage",
    )
    assert adapter_for("DupForCausalLM") is First
    assert adapter_for("OnlySecondForCausalLM") is Second
    assert type(open_storage("/tmp")) is LocalStorage  # a built-in wins over any plugin
    err = warned(recwarn)
    assert "plugin 'zeta' and plugin 'alpha' both claim architecture DupForCausalLM; using 'alpha'" in err
    assert "plugin 'aaa-storage' and plugin 'local' both claim uri scheme file; using 'local'" in err
    assert kvcdn_host.infos["zeta"].overridden == ["architecture DupForCausalLM (used: alpha)"]
    assert kvcdn_host.infos["zeta"].provides == {"architectures": ["DupForCausalLM", "OnlySecondForCausalLM"]}
    recwarn.clear()
    adapter_for("DupForCausalLM")
    assert warned(recwarn) == ""  # reported once


def test_duplicate_commands_keep_the_first_owner(plugin_dir, run_kvcdn):
    _fake_distribution(
        plugin_dir,
        "verify-hijack",
        "kvcdn.commands",
        "verify_hijack_mod",
        """
        import click
        from kvcdn_core import hookimpl

        @click.command("verify")
        def verify():
            click.echo("hijacked")

        @hookimpl
        def kvcdn_register_commands(cli):
            cli.add_command(verify)
        """,
    )
    env = {"PYTHONPATH": str(plugin_dir)}
    code, out, err = run_kvcdn("verify", "--help", env=env)
    assert code == 0 and "hijacked" not in out and "token-exact" in out
    assert "plugin 'verify-hijack' and plugin 'core' both claim command verify; using 'core'" in err
    code, out, _ = run_kvcdn("plugins", "--format", "json", env=env)
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["verify-hijack"]["overridden"] == ["command verify (used: core)"]
    assert rows["verify-hijack"]["distribution"] == "verify-hijack"


def test_plugins_lists_what_each_plugin_provides(run_kvcdn):
    code, out, _ = run_kvcdn("plugins", "--format", "json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert "Qwen3ForCausalLM" in rows["qwen"]["provides"]["architectures"]
    assert rows["core-quantizers"]["provides"]["schemes"] == ["int8-tensor", "int8", "fp8"]
    assert rows["lowbit"]["provides"]["schemes"] == ["int4", "int2"]
    assert rows["local"]["provides"]["uri_schemes"] == ["file"]
    assert rows["s3"]["provides"]["uri_schemes"] == ["s3"]
    assert {"generate", "verify", "plugins"} <= set(rows["core"]["provides"]["commands"])
    assert rows["ernie"]["description"] == "kvcdn model family plugin: Baidu ERNIE 4.5 dense"  # pyproject's
    code, out, _ = run_kvcdn("plugins")
    assert "lowbit: schemes: int4, int2" in out.splitlines()
    assert "local: uri schemes: file" in out.splitlines()
    assert "ernie: kvcdn model family plugin: Baidu ERNIE 4.5 dense" in out.splitlines()


def test_an_error_from_a_taken_over_scheme_names_both_plugins(kvcdn_host, recwarn, tmp_path):
    """A third party's int6 artifact refused with only "takes no parameter group_size" left its user
    guessing: another plugin had taken the scheme's name. The refusal now says which plugin is used."""
    import torch

    from kvcdn_core import artifact
    from kvcdn_core.errors import KvcdnError
    from kvcdn_core.plugin_host.registry import quantizer_for
    from kvcdn_core.quant.codec import dequantize_tensors, quantize_cache

    int8 = quantizer_for("int8")

    class Winner(int8):
        scheme = "int6"

    class Loser(int8):
        scheme = "int6"
        default_params = {**int8.default_params, "group_size": 32}

    for name, cls in (("zzz-int6", Loser), ("aaa-int6", Winner)):
        plugin = types.SimpleNamespace(kvcdn_register_quantizers=kvcdn_core.hookimpl(lambda cls=cls: [cls]))
        kvcdn_host.register(plugin, name, "kvcdn.quantizers")
    tokens = 6
    manifest = {
        "kvcdn_version": "test",
        "created_at": "2026-01-01T00:00:00+00:00",
        "model": {"id": "m", "architecture": "MForCausalLM"},
        "compute_dtype": "float32",
        "token_count": tokens,
        "layers": [
            {"index": 0, "kind": "full_attention", "tensors": {"key": "layers.0.key", "value": "layers.0.value"}}
        ],
    }
    tensors = {
        "layers.0.key": torch.randn(1, 1, tokens, 8),
        "layers.0.value": torch.randn(1, 1, tokens, 8),
        artifact.TOKEN_IDS: torch.arange(tokens),
    }
    result = quantize_cache(manifest, tensors, Loser())  # made where the other plugin was installed
    path = artifact.write_artifact(tmp_path / "six.kv", result.manifest, result.tensors)
    with pytest.raises(KvcdnError) as err:
        dequantize_tensors(artifact.read_header(path))
    message = str(err.value)
    assert "takes no parameter group_size" in message
    assert "scheme int6 is provided by plugin 'aaa-int6'; plugin 'zzz-int6' also claims it" in message


def test_an_error_from_a_taken_over_architecture_names_both_plugins(kvcdn_host, recwarn, tmp_path):
    """A model that fails to load through another family's adapter says which plugin serves it."""
    from kvcdn_core import ModelAdapter
    from kvcdn_core.errors import KvcdnError
    from kvcdn_core.runtime import load_session

    class Winner(ModelAdapter):
        family = "winner"
        architectures = ("DupForCausalLM",)

        def load(self, model_dir, device, dtype):
            raise ValueError("unexpected key 'layers.0.mixer'")

    class Loser(ModelAdapter):
        family = "loser"
        architectures = ("DupForCausalLM",)

    for name, cls in (("zzz-family", Loser), ("aaa-family", Winner)):
        plugin = types.SimpleNamespace(kvcdn_register_model_adapters=kvcdn_core.hookimpl(lambda cls=cls: [cls]))
        kvcdn_host.register(plugin, name, "kvcdn.models")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DupForCausalLM"]}))
    with pytest.raises(KvcdnError) as err:
        load_session(str(tmp_path), device="cpu")
    message = str(err.value)
    assert "unexpected key 'layers.0.mixer'" in message
    assert "architecture DupForCausalLM is provided by plugin 'aaa-family'; plugin 'zzz-family' also claims it" in (
        message
    )


def test_an_error_from_a_taken_over_uri_scheme_names_both_plugins(kvcdn_host, recwarn):
    """A storage URI the winning backend refuses says which plugin's backend was used."""
    from kvcdn_core import LocalStorage
    from kvcdn_core.errors import KvcdnError
    from kvcdn_core.plugin_host.registry import open_storage

    class Winner(LocalStorage):
        schemes = ("dup",)

        @classmethod
        def from_uri(cls, uri):
            raise KvcdnError(f"{uri}: expected dup://bucket/prefix")

    class Loser(LocalStorage):
        schemes = ("dup",)

    for name, cls in (("zzz-dup", Loser), ("aaa-dup", Winner)):
        plugin = types.SimpleNamespace(kvcdn_register_storage_backends=kvcdn_core.hookimpl(lambda cls=cls: [cls]))
        kvcdn_host.register(plugin, name, "kvcdn.storage")
    with pytest.raises(KvcdnError) as err:
        open_storage("dup://x")
    message = str(err.value)
    assert "dup://x: expected dup://bucket/prefix" in message
    assert "uri scheme dup is provided by plugin 'aaa-dup'; plugin 'zzz-dup' also claims it" in message


def test_an_entry_point_group_does_not_limit_which_hooks_run(tmp_path, run_kvcdn):
    """What the guide says: the group names a module, and every hook the module implements runs. A
    module named under ``kvcdn.commands`` that registers a quantizer serves its scheme."""
    import os

    site = tmp_path / "site"
    site.mkdir()
    _fake_distribution(
        site,
        "cross-group",
        "kvcdn.commands",
        "cross_group_mod",
        """
        from kvcdn_core import Quantizer, hookimpl

        class CrossGroup(Quantizer):
            scheme = "cross-group"
            description = "a scheme registered from a module named in kvcdn.commands"

        @hookimpl
        def kvcdn_register_quantizers():
            return [CrossGroup]
        """,
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    code, out, err = run_kvcdn("plugins", "--format", "json", env=env)
    assert code == 0, err
    row = {row["name"]: row for row in json.loads(out)}["cross-group"]
    assert row["groups"] == ["kvcdn.commands"] and row["status"] == "loaded"
    assert row["hooks"] == ["kvcdn_register_quantizers"]
    assert row["provides"] == {"schemes": ["cross-group"]}
    code, out, err = run_kvcdn("quant", "--help", env=env)
    assert code == 0 and "cross-group (a scheme registered from a module" in " ".join(out.split()), err
