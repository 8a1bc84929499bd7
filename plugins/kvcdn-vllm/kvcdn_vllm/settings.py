"""The connector's ``kv_connector_extra_config`` keys, checked once at engine start (no torch)."""

from __future__ import annotations

import dataclasses
from typing import Any

#: Every key the connector reads; anything else is refused, so a typo does not go unnoticed.
KEYS = ("source", "save", "min_tokens")


@dataclasses.dataclass(frozen=True)
class Settings:
    """``source``: directory or storage URI of artifacts; ``save``: write prompts back as artifacts;
    ``min_tokens``: neither load nor save prefixes shorter than this (default: one block)."""

    source: str
    save: bool
    min_tokens: int

    @classmethod
    def parse(cls, extra: dict[str, Any] | None, block_size: int) -> Settings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(
                f"kvcdn connector: unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                f"known: {', '.join(KEYS)}"
            )
        source = extra.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ValueError(
                "kvcdn connector: kv_connector_extra_config needs 'source', a directory or a "
                "storage URI of .kv artifacts"
            )
        save = extra.get("save", False)
        if isinstance(save, str) and save.lower() in ("true", "false"):
            save = save.lower() == "true"
        if not isinstance(save, bool):
            raise ValueError(f"kvcdn connector: 'save' must be true or false, not {save!r}")
        min_tokens = extra.get("min_tokens", block_size)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"kvcdn connector: 'min_tokens' must be a positive integer, not {min_tokens!r}")
        return cls(source.strip(), save, min_tokens)
