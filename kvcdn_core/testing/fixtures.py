"""pytest fixtures for kvcdn and its plugins (loaded through the ``pytest11`` entry point)."""

from __future__ import annotations

import pytest


@pytest.fixture
def kvcdn_host(monkeypatch):
    """A fresh plugin host with only core's built-ins, installed as the process-wide host.

    Register a plugin in-process with ``kvcdn_host.register(module_or_object, "name", "kvcdn.models")``.
    """
    from kvcdn_core.plugin_host import manager

    host = manager.PluginHost(discover=False)
    monkeypatch.setattr(manager, "_HOST", host)
    return host


@pytest.fixture
def discovered_host(monkeypatch):
    """A fresh host that discovers installed plugins (after tests changed the environment)."""
    from kvcdn_core.plugin_host import manager

    host = manager.PluginHost()
    monkeypatch.setattr(manager, "_HOST", host)
    return host


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory ``tiny_model(adapter_cls, architecture) -> Path``: a saved tiny model, built once."""
    from kvcdn_core.model.tiny import build_tiny_model

    built = {}

    def make(adapter_cls, architecture):
        key = (adapter_cls, architecture)
        if key not in built:
            out = tmp_path_factory.mktemp(architecture)
            built[key] = build_tiny_model(adapter_cls, architecture, out)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_session(tiny_model):
    """Factory ``tiny_session(adapter_cls, architecture)``: its tiny model loaded (float32, CPU), once."""
    from kvcdn_core import runtime

    loaded = {}

    def get(adapter_cls, architecture):
        key = (adapter_cls, architecture)
        if key not in loaded:
            path = tiny_model(adapter_cls, architecture)
            loaded[key] = runtime.load_session(str(path), device="cpu", dtype="float32", adapter_cls=adapter_cls)
        return loaded[key]

    return get
