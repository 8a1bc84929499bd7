"""The ``kv_<hex>`` org API key form, checked locally so that a typo is caught before any request."""

from __future__ import annotations

import string

from kvcdn_core import KvcdnError

PREFIX = "kv_"
#: hex of a 32-byte HKDF-SHA256 output
HEX_LENGTH = 64


def validate_api_key(key: str) -> str:
    """Return the key normalized (stripped, lower-case hex) or say which part is wrong."""
    key = (key or "").strip()
    if not key:
        raise KvcdnError("API key is empty: expected 'kv_' followed by 64 hex characters")
    if not key.startswith(PREFIX):
        shown = key[:3]
        raise KvcdnError(
            f"API key must start with 'kv_' (it starts with '{shown}'); expected 'kv_' followed by 64 hex characters"
        )
    body = key[len(PREFIX) :]
    for position, char in enumerate(body, start=len(PREFIX) + 1):
        if char not in string.hexdigits:
            shown = char if char.isprintable() else repr(char)[1:-1]
            raise KvcdnError(
                f"API key has a non-hex character '{shown}' at position {position}; "
                "after 'kv_' only 0-9 and a-f are allowed"
            )
    if len(body) != HEX_LENGTH:
        raise KvcdnError(f"API key has {len(body)} hex characters after 'kv_', expected {HEX_LENGTH}")
    return PREFIX + body.lower()


def mask(key: str) -> str:
    """A key as it may be shown to people: prefix and last four characters."""
    return f"{key[:3]}…{key[-4:]}" if len(key) > 8 else "***"
