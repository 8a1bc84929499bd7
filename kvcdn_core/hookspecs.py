"""Every hook a kvcdn plugin can implement.

Hooks are pluggy hooks of the project ``kvcdn``; implement them with ``@kvcdn_core.hookimpl`` in the
module your entry point names. Registration hooks return *classes*, not instances, so that nothing
heavy (torch, transformers, boto3) is imported until a class is actually used.

Specs only ever change additively: a new hook or a new optional argument, never a changed meaning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    import click

    from kvcdn_core.adapter import ModelAdapter
    from kvcdn_core.quant import Quantizer
    from kvcdn_core.storage import StorageBackend

hookspec = pluggy.HookspecMarker("kvcdn")


@hookspec
def kvcdn_register_model_adapters() -> list[type[ModelAdapter]]:
    """Return the model-adapter classes this plugin provides.

    Each class lists the ``config.json`` ``architectures`` it serves in ``architectures`` and a tiny
    offline validation config for each in ``validation_configs``. When two adapters claim the same
    architecture, the one registered last wins and ``kvcdn plugins`` shows both.

    :return: a list of :class:`kvcdn_core.adapter.ModelAdapter` subclasses.
    """


@hookspec
def kvcdn_adapt_unclaimed_architecture(architecture: str, config: dict) -> type[ModelAdapter] | str | None:
    """Offer an adapter for an architecture that no family plugin claims (the generic adapter).

    Called only when no registered adapter claims ``architecture``; ``config`` is the model's
    ``config.json``. Return an adapter class to serve it, a one-line string saying why it is refused
    (the user sees it), or None for no opinion. The first class or string returned wins.
    """


@hookspec
def kvcdn_register_quantizers() -> list[type[Quantizer]]:
    """Return the quantizer classes this plugin provides.

    Each class has a unique ``scheme`` name (the value of ``kvcdn quant --scheme``) and declares
    the layer kinds it supports.

    :return: a list of :class:`kvcdn_core.quant.Quantizer` subclasses.
    """


@hookspec
def kvcdn_register_storage_backends() -> list[type[StorageBackend]]:
    """Return the storage-backend classes this plugin provides.

    Each class names the URI schemes it serves in ``schemes`` (``file``, ``s3``, ``kvcdn``...).

    :return: a list of :class:`kvcdn_core.storage.StorageBackend` subclasses.
    """


@hookspec
def kvcdn_register_commands(cli: click.Group) -> None:
    """Add click commands to the ``kvcdn`` command group.

    Called once at start-up for every loaded plugin. Keep the module that implements this cheap to
    import: import torch, transformers and other heavy libraries inside the command functions.

    :param cli: the root ``kvcdn`` click group; call ``cli.add_command(...)``.
    """
