"""What library code tells a person while it works, without printing: warnings and notes.

Library code never writes to stderr or stdout (a test checks it). It reports a warning with
:func:`warn` and a note about slow work with :func:`note`, both through Python's :mod:`warnings`;
progress goes through :mod:`kvcdn_core.progress`. A command shows them with
:func:`kvcdn_core.cli.render.reporting` (``warning: <message>``, the note as it is, on stderr); a program
using the library sees ordinary Python warnings, which it can filter, record or turn into errors.
"""

from __future__ import annotations

import warnings


class KvcdnWarning(UserWarning):
    """Something a person should know that did not stop the work; a command shows ``warning: <message>``."""


class KvcdnNote(UserWarning):
    """A note about slow or unusual work under way; a command shows the message as it is."""


def warn(message: str) -> None:
    """Report ``message`` as a :class:`KvcdnWarning` (attributed to the caller's caller)."""
    warnings.warn(message, KvcdnWarning, stacklevel=3)


def note(message: str) -> None:
    """Report ``message`` as a :class:`KvcdnNote` (attributed to the caller's caller)."""
    warnings.warn(message, KvcdnNote, stacklevel=3)
