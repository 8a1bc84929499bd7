"""Errors that the CLI turns into one line on stderr and an exit code.

Exit codes follow the usual convention: 0 success, 1 a check failed, 2 usage or input error.
"""


class KvcdnError(Exception):
    """A user-facing error: bad input, unreadable file, missing model. Exit code 2."""

    exit_code = 2


class CheckFailed(KvcdnError):
    """A check ran and did not pass (verify mismatch, diag over threshold). Exit code 1."""

    exit_code = 1


class ArtifactError(KvcdnError):
    """A `.kv` file that is truncated, corrupted, foreign or of an unknown format version."""


def interruption(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``exc``, if any: a library that catches it mid-import (transformers' lazy
    modules do) hands on another exception whose ``__cause__`` or ``__context__`` is the interrupt."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, KeyboardInterrupt):
            return current
        stack += [current.__cause__, current.__context__]
    return None
