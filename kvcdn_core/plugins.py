"""The plugin host: entry-point discovery with stevedore, hooks with pluggy, failure isolation.

Each entry point names a module (or object) that implements ``kvcdn_*`` hooks. It is registered in
pluggy under its qualified name ``group:name`` (pluggy silently ignores a second plugin with a name
it already knows). A plugin that fails to import, implements a hook kvcdn does not know, or raises
from a hook is reported on one stderr line and skipped; the rest keep working.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
import traceback
from typing import Any

import pluggy

from kvcdn_core import hookspecs

GROUPS = ("kvcdn.models", "kvcdn.quantizers", "kvcdn.storage", "kvcdn.commands")

#: Core's own parts, registered through the same hooks as any plugin: (group, name, module).
BUILTINS = (
    ("kvcdn.commands", "core", "kvcdn_core.commands"),
    ("kvcdn.storage", "local", "kvcdn_core.storage"),
    ("kvcdn.quantizers", "core-quantizers", "kvcdn_core.quantizers"),
)


@dataclasses.dataclass
class PluginInfo:
    """What ``kvcdn plugins`` shows for one discovered plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    groups: list[str] = dataclasses.field(default_factory=list)
    hooks: list[str] = dataclasses.field(default_factory=list)
    status: str = "loaded"  # loaded | failed | blocked
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def debug_enabled() -> bool:
    return os.environ.get("KVCDN_DEBUG", "") not in ("", "0")


def disabled_names() -> set[str]:
    raw = os.environ.get("KVCDN_DISABLE_PLUGINS", "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class PluginHost:
    """Discovers, registers and queries kvcdn plugins.

    ``discover=False`` gives an empty host with only the built-ins, for tests that register plugins
    in-process (see :mod:`kvcdn_core.testing`).
    """

    def __init__(self, discover: bool = True, warn=None):
        self.pm = pluggy.PluginManager("kvcdn")
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self._warn = warn or (lambda line: print(line, file=sys.stderr))
        self._blocked = disabled_names()
        import kvcdn_core

        for group, name, module in BUILTINS:
            obj = importlib.import_module(module)
            self.register(obj, name, group, distribution="kvcdn", version=kvcdn_core.__version__)
        if discover:
            for group in GROUPS:
                self._discover(group)

    # -- discovery ---------------------------------------------------------------------------

    def _discover(self, group: str) -> None:
        from stevedore import ExtensionManager

        def failed(_manager, entry_point, exc):
            dist, version = _distribution_of(entry_point)
            self._fail(entry_point.name, group, exc, dist, version, what="failed to load")

        blocked = self._blocked

        class _Manager(ExtensionManager):
            def _load_one_plugin(self, ep, *args, **kwargs):
                if _is_blocked(ep, blocked):
                    return None
                return super()._load_one_plugin(ep, *args, **kwargs)

        manager = _Manager(group, on_load_failure_callback=failed)
        for ep in manager.list_entry_points():
            if _is_blocked(ep, blocked):
                dist, version = _distribution_of(ep)
                info = self._info(ep.name, dist, version)
                info.status = "blocked"
                _add(info.groups, group)
        for ext in manager.extensions:
            dist, version = _distribution_of(ext.entry_point)
            self.register(ext.plugin, ext.name, group, distribution=dist, version=version)

    def _info(self, name: str, dist: str | None, version: str | None) -> PluginInfo:
        info = self.infos.setdefault(name, PluginInfo(name=name))
        info.distribution = info.distribution or dist
        info.version = info.version or version
        return info

    def _fail(self, name, group, exc, dist=None, version=None, what="failed") -> None:
        info = self._info(name, dist, version)
        _add(info.groups, group)
        info.status = "failed"
        info.error = _one_line(exc)
        hint = "" if debug_enabled() else " (set KVCDN_DEBUG=1 for the traceback)"
        self._warn(f"warning: plugin '{name}' ({group}) {what}, skipped: {info.error}{hint}")
        if debug_enabled():
            self._warn("".join(traceback.format_exception(exc)).rstrip())

    # -- registration ------------------------------------------------------------------------

    def register(self, obj: Any, name: str, group: str, distribution=None, version=None) -> None:
        """Register ``obj`` (a module or object with hook implementations) as plugin ``name``."""
        info = self._info(name, distribution, version)
        _add(info.groups, group)
        if info.status == "failed":
            return
        if self.pm.is_registered(obj):  # one module serving several groups
            return
        try:
            self.pm.register(obj, name=f"{group}:{name}")
        except Exception as exc:  # pluggy validation: bad hookimpl signature
            self._fail(name, group, exc, what="is invalid")
            return
        unknown = [
            caller.name for caller in (self.pm.get_hookcallers(obj) or []) if caller.spec is None
        ]
        if unknown:
            self.pm.unregister(obj)
            self._fail(
                name, group, pluggy.PluginValidationError(obj, f"unknown hook {', '.join(unknown)}"),
                what="implements an unknown hook",
            )
            return
        for caller in self.pm.get_hookcallers(obj) or []:
            _add(info.hooks, caller.name)

    # -- hook calls, isolated per plugin ---------------------------------------------------

    def call_each(self, hook_name: str, **kwargs) -> list[tuple[str, Any]]:
        """Call one hook on each plugin separately, so that one failing plugin cannot break the rest."""
        results = []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            qualified = impl.plugin_name
            group, _, name = qualified.partition(":")
            try:
                result = impl.function(**{k: kwargs[k] for k in impl.argnames})
            except Exception as exc:
                self.pm.unregister(impl.plugin)
                self._fail(name, group, exc, what=f"raised in {hook_name}")
                continue
            results.append((name, result))
        return results

    def _classes(self, hook_name: str, key: str) -> dict[str, type]:
        found: dict[str, type] = {}
        for name, classes in reversed(self.call_each(hook_name)):  # pluggy calls LIFO
            try:  # a plugin returning something else than classes naming their key is skipped
                claims = {value: cls for cls in (classes or []) for value in _as_tuple(getattr(cls, key))}
                if not all(isinstance(cls, type) and isinstance(v, str) for v, cls in claims.items()):
                    raise TypeError(f"{hook_name} must return a list of classes")
            except Exception as exc:
                self._drop(name, exc, f"returned an invalid result from {hook_name}")
                continue
            found.update(claims)
        return found

    def _drop(self, name: str, exc: BaseException, what: str) -> None:
        for plugin_name, plugin in self.pm.list_name_plugin():
            group, _, short = plugin_name.partition(":")
            if short == name:
                self.pm.unregister(plugin)
                self._fail(name, group, exc, what=what)
                return

    def model_adapters(self) -> dict[str, type]:
        """Architecture name (``config.json`` ``architectures``) → adapter class."""
        return self._classes("kvcdn_register_model_adapters", "architectures")

    def quantizers(self) -> dict[str, type]:
        """Scheme name → quantizer class."""
        return self._classes("kvcdn_register_quantizers", "scheme")

    def storage_backends(self) -> dict[str, type]:
        """URI scheme → storage backend class."""
        return self._classes("kvcdn_register_storage_backends", "schemes")

    def register_commands(self, cli) -> None:
        self.call_each("kvcdn_register_commands", cli=cli)

    def families(self) -> dict[str, type]:
        """Adapter family name → adapter class, for messages and ``kvcdn validate``."""
        return {cls.family: cls for cls in self.model_adapters().values()}


def _as_tuple(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value)


def _add(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)


def _is_blocked(ep, blocked: set[str]) -> bool:
    if not blocked:
        return False
    dist, _ = _distribution_of(ep)
    return bool({ep.name, f"{ep.group}:{ep.name}", dist or ""} & blocked)


_OWNERS: dict[tuple[str, str, str], tuple[str, str]] | None = None


def _distribution_of(ep) -> tuple[str | None, str | None]:
    """The distribution (name, version) that ships an entry point."""
    dist = getattr(ep, "dist", None)
    if dist is not None:
        return dist.metadata["Name"], dist.version
    global _OWNERS
    if _OWNERS is None:  # stevedore's cached entry points carry no distribution: look it up once
        _OWNERS = {}
        for d in importlib.metadata.distributions():
            for e in d.entry_points:
                if e.group in GROUPS:
                    _OWNERS[(e.group, e.name, e.value)] = (d.metadata["Name"], d.version)
    return _OWNERS.get((ep.group, ep.name, ep.value), (None, None))


_HOST: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide plugin host, created on first use."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST


def set_host(host: PluginHost | None) -> None:
    """Replace the process-wide host (tests register plugins in-process this way)."""
    global _HOST
    _HOST = host
