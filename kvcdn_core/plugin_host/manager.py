"""The plugin host: entry-point discovery with stevedore, hooks with pluggy, failure isolation.

Each entry point names a module (or object) that implements ``kvcdn_*`` hooks. It is registered in
pluggy under its qualified name ``group:name`` (pluggy silently ignores a second plugin with a name
it already knows). A plugin that fails to import, implements a hook kvcdn does not know, or raises
from a hook is reported as one warning (:func:`kvcdn_core.notices.warn`; the CLI shows it as one
stderr line) and skipped; the rest keep working.

Only :mod:`kvcdn_core.plugin_host.registry` asks the host for classes; commands and library code ask the registry.

**Precedence.** When two plugins claim the same architecture, quantization scheme, URI scheme or
command name, core's built-ins win, then plugins in the order of their names; the others' claims
are ignored, reported once as a warning and shown by ``kvcdn plugins``.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable
from typing import Any

import pluggy

from kvcdn_core import notices
from kvcdn_core.plugin_host import hookspecs

GROUPS = ("kvcdn.models", "kvcdn.quantizers", "kvcdn.storage", "kvcdn.commands")

#: Core's own parts, registered through the same hooks as any plugin: (group, name, module).
BUILTINS = (
    ("kvcdn.commands", "core", "kvcdn_core.builtin.commands"),
    ("kvcdn.storage", "local", "kvcdn_core.builtin.local_storage"),
    ("kvcdn.quantizers", "core-quantizers", "kvcdn_core.builtin.quantizers"),
)
BUILTIN_NAMES = frozenset(name for _, name, _ in BUILTINS)

#: What each registration hook's classes claim: hook → (kind shown to users, class attribute).
CLAIMS = {
    "kvcdn_register_model_adapters": ("architectures", "architectures"),
    "kvcdn_register_quantizers": ("schemes", "scheme"),
    "kvcdn_register_storage_backends": ("uri_schemes", "schemes"),
}


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
    #: kind (architectures, schemes, uri_schemes, commands) → the names this plugin claims.
    provides: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: claims another plugin won under the precedence rule: ``"<kind> <name> (used: <plugin>)"``.
    overridden: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The row ``kvcdn plugins`` shows, with the distribution's one-line description."""
        return {**dataclasses.asdict(self), "description": description_of(self.distribution)}


def description_of(distribution: str | None) -> str | None:
    """A distribution's one-line description (``description`` in its pyproject.toml), or None.

    Read from the installed metadata only when ``kvcdn plugins`` asks, never at start-up."""
    if not distribution:
        return None
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        meta = metadata(distribution)
    except PackageNotFoundError:
        return None
    return (meta["Summary"] or None) if "Summary" in meta else None


def debug_enabled() -> bool:
    return os.environ.get("KVCDN_DEBUG", "") not in ("", "0")


def disabled_names() -> set[str]:
    raw = os.environ.get("KVCDN_DISABLE_PLUGINS", "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def precedence(name: str) -> tuple[int, str]:
    """Sort key of a plugin's claims: built-ins first, then plugins by name."""
    return (0 if name in BUILTIN_NAMES else 1, name)


class PluginHost:
    """Discovers, registers and queries kvcdn plugins.

    ``discover=False`` gives an empty host with only the built-ins, for tests that register plugins
    in-process (see :mod:`kvcdn_core.testing`).
    """

    def __init__(self, discover: bool = True):
        import importlib

        import kvcdn_core

        self.pm = pluggy.PluginManager("kvcdn")
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self._blocked = disabled_names()
        self._claims: dict[str, dict[str, type]] = {}
        for group, name, module in BUILTINS:  # by name, like an entry point: core imports no built-in
            obj = importlib.import_module(module)
            self.register(obj, name, group, distribution="kvcdn", version=kvcdn_core.__version__)
        if discover:
            for group in GROUPS:
                self._discover(group)

    # -- discovery ---------------------------------------------------------------------------

    def _discover(self, group: str) -> None:
        """Load a group's entry points with stevedore, except blocked ones, which are never imported.

        The standard library's entry points of the group carry their distribution (name, version),
        which stevedore's cached entry points do not.
        """
        from importlib.metadata import entry_points

        from stevedore import NamedExtensionManager

        declared = {ep.name: ep for ep in entry_points(group=group)}

        def failed(_manager: Any, entry_point: Any, exc: BaseException) -> None:
            dist, version = _distribution_of(declared.get(entry_point.name))
            self._fail(entry_point.name, group, exc, dist, version, what="failed to load")

        wanted = []
        for name, ep in declared.items():
            if self._is_blocked(ep):
                dist, version = _distribution_of(ep)
                info = self._info(name, dist, version)
                info.status = "blocked"
                _add(info.groups, group)
            else:
                wanted.append(name)
        manager = NamedExtensionManager(
            group, names=wanted, on_load_failure_callback=failed, warn_on_missing_entrypoint=False
        )
        for ext in manager.extensions:
            dist, version = _distribution_of(declared.get(ext.name))
            self.register(ext.plugin, ext.name, group, distribution=dist, version=version)

    def _is_blocked(self, ep: Any) -> bool:
        if not self._blocked:
            return False
        dist, _ = _distribution_of(ep)
        return bool({ep.name, f"{ep.group}:{ep.name}", dist or ""} & self._blocked)

    def _info(self, name: str, dist: str | None, version: str | None) -> PluginInfo:
        info = self.infos.setdefault(name, PluginInfo(name=name))
        info.distribution = info.distribution or dist
        info.version = info.version or version
        return info

    def _fail(
        self,
        name: str,
        group: str,
        exc: BaseException,
        dist: str | None = None,
        version: str | None = None,
        what: str = "failed",
    ) -> None:
        info = self._info(name, dist, version)
        _add(info.groups, group)
        info.status = "failed"
        info.error = _one_line(exc)
        hint = "" if debug_enabled() else " (set KVCDN_DEBUG=1 for the traceback)"
        notices.warn(f"plugin '{name}' ({group}) {what}, skipped: {info.error}{hint}")
        if debug_enabled():
            notices.note("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())

    # -- registration ------------------------------------------------------------------------

    def register(
        self, obj: Any, name: str, group: str, distribution: str | None = None, version: str | None = None
    ) -> None:
        """Register ``obj`` (a module or object with hook implementations) as plugin ``name``."""
        self._claims.clear()
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
        unknown = [caller.name for caller in (self.pm.get_hookcallers(obj) or []) if caller.spec is None]
        if unknown:
            self.pm.unregister(obj)
            self._fail(
                name,
                group,
                pluggy.PluginValidationError(obj, f"unknown hook {', '.join(unknown)}"),
                what="implements an unknown hook",
            )
            return
        for caller in self.pm.get_hookcallers(obj) or []:
            _add(info.hooks, caller.name)

    # -- hook calls, isolated per plugin ---------------------------------------------------

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call one hook on each plugin separately, in precedence order, so that one failing plugin
        cannot break the rest: ``[(plugin name, result)]``."""
        return self._call_each(hook_name, lambda _name: kwargs)

    def _call_each(self, hook_name: str, kwargs_for: Callable[[str], dict[str, Any]]) -> list[tuple[str, Any]]:
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        results = []
        for impl in sorted(impls, key=lambda i: precedence(i.plugin_name.partition(":")[2])):
            group, _, name = impl.plugin_name.partition(":")
            kwargs = kwargs_for(name)
            try:
                result = impl.function(**{k: kwargs[k] for k in impl.argnames})
            except Exception as exc:
                self.pm.unregister(impl.plugin)
                self._fail(name, group, exc, what=f"raised in {hook_name}")
                continue
            results.append((name, result))
        return results

    def _classes(self, hook_name: str) -> dict[str, type]:
        """Claimed name → class for one registration hook; the first claim by precedence wins."""
        if hook_name in self._claims:
            return self._claims[hook_name]
        kind, attribute = CLAIMS[hook_name]
        found: dict[str, type] = {}
        owner: dict[str, str] = {}
        for name, classes in self.call_each(hook_name):
            try:  # a plugin returning something else than classes naming their key is skipped
                claims = [(value, cls) for cls in (classes or []) for value in _as_tuple(getattr(cls, attribute))]
                if not all(isinstance(cls, type) and isinstance(v, str) for v, cls in claims):
                    raise TypeError(f"{hook_name} must return a list of classes")
            except Exception as exc:
                self._drop(name, exc, f"returned an invalid result from {hook_name}")
                continue
            info = self.infos[name]
            for value, cls in claims:
                _add(info.provides.setdefault(kind, []), value)
                if value in found and owner[value] != name:
                    self._overridden(name, kind, value, owner[value])
                    continue
                found.setdefault(value, cls)
                owner.setdefault(value, name)
        self._claims[hook_name] = found
        return found

    def _overridden(self, name: str, kind: str, value: str, winner: str) -> None:
        line = f"{kind.rstrip('s').replace('_', ' ')} {value} (used: {winner})"
        info = self.infos[name]
        if line not in info.overridden:
            info.overridden.append(line)
            notices.warn(
                f"plugin '{name}' and plugin '{winner}' both claim {line.partition(' (')[0]}; using '{winner}'"
            )

    def contenders(self, kind: str, value: str) -> tuple[str, list[str]] | None:
        """For a name two plugins claimed (``kind`` as in :data:`CLAIMS`: ``schemes``...): the plugin
        whose class is used and the plugins that lost it; None when one plugin claims it alone."""
        for hook_name, (claim_kind, _) in CLAIMS.items():
            if claim_kind == kind:
                self._classes(hook_name)
        prefix = f"{kind.rstrip('s').replace('_', ' ')} {value} (used: "
        winner, losers = "", []
        for name, info in self.infos.items():
            for line in info.overridden:
                if line.startswith(prefix):
                    winner = line[len(prefix) : -1]
                    losers.append(name)
        return (winner, sorted(losers)) if losers else None

    def _drop(self, name: str, exc: BaseException, what: str) -> None:
        for plugin_name, plugin in self.pm.list_name_plugin():
            group, _, short = plugin_name.partition(":")
            if short == name:
                self.pm.unregister(plugin)
                self._fail(name, group, exc, what=what)
                return

    def model_adapters(self) -> dict[str, type]:
        """Architecture name (``config.json`` ``architectures``) → adapter class."""
        return self._classes("kvcdn_register_model_adapters")

    def quantizers(self) -> dict[str, type]:
        """Scheme name → quantizer class."""
        return self._classes("kvcdn_register_quantizers")

    def storage_backends(self) -> dict[str, type]:
        """URI scheme → storage backend class."""
        return self._classes("kvcdn_register_storage_backends")

    def claims(self) -> None:
        """Ask every registration hook once, so ``infos`` shows what each plugin provides."""
        for hook_name in CLAIMS:
            self._classes(hook_name)

    def register_commands(self, cli: Any) -> None:
        """Add every plugin's commands to ``cli``; a command name keeps its first owner by precedence.

        Each plugin adds its commands to a group of its own first, so that what it claims is known
        and a second claim of a name cannot replace the first one.
        """
        import click

        owners: dict[str, str] = {}
        groups: dict[str, click.Group] = {}

        def own_group(name: str) -> dict[str, Any]:
            groups[name] = click.Group(cli.name)
            return {"cli": groups[name]}

        for name, _ in self._call_each("kvcdn_register_commands", own_group):
            info = self.infos[name]
            for command_name, command in groups[name].commands.items():
                _add(info.provides.setdefault("commands", []), command_name)
                if command_name in owners:
                    self._overridden(name, "commands", command_name, owners[command_name])
                    continue
                owners[command_name] = name
                cli.add_command(command, command_name)


def _as_tuple(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _add(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)


def _distribution_of(ep: Any) -> tuple[str | None, str | None]:
    """The distribution (name, version) that ships an entry point, from the entry point itself."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


_HOST: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide plugin host, created on first use (ask :mod:`kvcdn_core.plugin_host.registry` instead)."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST


def set_host(host: PluginHost | None) -> None:
    """Replace the process-wide host (tests register plugins in-process this way)."""
    global _HOST
    _HOST = host
