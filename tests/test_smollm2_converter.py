"""Where the SmolLM2 test model is converted to, and that the package's GGUF is found."""

from __future__ import annotations

from kvcdn_core.testing import smollm2


def test_cache_dir_follows_the_override_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCDN_TEST_CACHE", str(tmp_path / "override"))
    assert smollm2.cache_dir() == tmp_path / "override"
    monkeypatch.delenv("KVCDN_TEST_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.cache_dir() == tmp_path / "xdg" / "kvcdn" / "test-models" / "smollm2-135m-instruct"


def test_the_installed_package_ships_one_gguf():
    path = smollm2.gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_a_finished_folder_is_reused_without_converting(monkeypatch, tmp_path):
    done = tmp_path / "model"
    done.mkdir()
    (done / smollm2.MARKER).write_text("done\n")
    monkeypatch.setenv("KVCDN_TEST_CACHE", str(done))
    monkeypatch.setattr(smollm2, "convert", lambda *a: (_ for _ in ()).throw(AssertionError("converted")))
    assert smollm2.smollm2_dir() == done


def test_a_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    target = tmp_path / "cache" / "model"
    monkeypatch.setenv("KVCDN_TEST_CACHE", str(target))

    def broken(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "convert", broken)
    try:
        smollm2.smollm2_dir()
    except RuntimeError:
        pass
    else:
        raise AssertionError("the conversion error was swallowed")
    assert list(target.parent.iterdir()) == []
