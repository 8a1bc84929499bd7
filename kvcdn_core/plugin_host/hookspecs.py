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

    from kvcdn_core.contracts.adapter import ModelAdapter
    from kvcdn_core.contracts.quantizer import Quantizer
    from kvcdn_core.contracts.storage import StorageBackend

hookspec = pluggy.HookspecMarker("kvcdn")


@hookspec
def kvcdn_register_model_adapters() -> list[type[ModelAdapter]]:
    """Return the model-adapter classes this plugin provides.

    Each class lists the ``config.json`` ``architectures`` it serves in ``architectures`` and a tiny
    offline validation config for each in ``validation_configs``. When two plugins claim the same
    architecture, core's built-ins win, then plugins by name; ``kvcdn plugins`` shows both claims.

    :return: a list of :class:`kvcdn_core.ModelAdapter` subclasses.
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

    Each class has a ``scheme`` name (the value of ``kvcdn quant --scheme``) and declares the layer
    kinds it supports. A scheme two plugins claim goes to the first by precedence (built-ins, then
    plugins by name).

    :return: a list of :class:`kvcdn_core.Quantizer` subclasses.
    """


@hookspec
def kvcdn_register_storage_backends() -> list[type[StorageBackend]]:
    """Return the storage-backend classes this plugin provides.

    Each class names the URI schemes it serves in ``schemes`` (``file``, ``s3``, ``kvcdn``...); the
    registry calls its ``from_uri`` with the whole URI. A URI scheme two plugins claim goes to the
    first by precedence (built-ins, then plugins by name).

    :return: a list of :class:`kvcdn_core.StorageBackend` subclasses.
    """


@hookspec
def kvcdn_register_commands(cli: click.Group) -> None:
    """Add click commands to the ``kvcdn`` command group.

    Called once at start-up for every loaded plugin. A command name two plugins add keeps the
    first by precedence (built-ins, then plugins by name). Keep the module that implements this cheap to
    import: import torch, transformers and other heavy libraries inside the command functions.

    :param cli: the root ``kvcdn`` click group; call ``cli.add_command(...)``.
    """
