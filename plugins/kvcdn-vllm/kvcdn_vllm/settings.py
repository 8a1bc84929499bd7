"""The connector's ``kv_connector_extra_config`` keys, declared once (:data:`SETTINGS`, which
docs/vllm.md shows) and checked once at engine start (no torch)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcdn_core import KvcdnError, settings

#: Every key the connector reads, with the ``kvcdn vllm-serve`` flag that writes it; anything else
#: is refused, so a typo does not go unnoticed. vLLM hands the connector only this dict: no
#: environment variable or file of its own.
SETTINGS: tuple[settings.Setting, ...] = (
    settings.Setting(
        "source",
        "Where artifacts live: a directory (searched recursively), `file://...`, or any URI an installed "
        "kvcdn storage backend serves (`s3://bucket/prefix` with `kvcdn[s3]`, the hosted service with "
        "`kvcdn[hosted]`). A store whose backend declares `local_path` (a directory, `file://...`) is read "
        "in place; any other is mirrored into `$XDG_CACHE_HOME/kvcdn/vllm-mirror/` (new or changed `.kv` "
        "objects are fetched at most every 30 s, before a search) and saved artifacts are uploaded back.",
        flag="--source",
        default_doc="required",
    ),
    settings.Setting(
        "save",
        "`true`: write each prompt that no artifact holds yet as an artifact in `source` (`vllm-<hash of its "
        "token ids>.kv`), in the step that computes its last prompt token. Saving needs the whole cache in "
        "one worker: it is off (with one warning) under tensor or pipeline parallelism.",
        settings.boolean,
        False,
        flag="--save",
    ),
    settings.Setting(
        "min_tokens",
        "Neither load nor save prefixes shorter than this many tokens.",
        settings.integer(1),
        flag="--min-tokens",
        default_doc="one vLLM block",
    ),
)
KEYS = tuple(s.name for s in SETTINGS)
LABEL = "kv_connector_extra_config"


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
        try:
            settings.check_keys(extra, SETTINGS, LABEL)
            values, _ = settings.resolve(SETTINGS, file_values=extra, file_path=LABEL, environ={}, file_label=LABEL)
        except KvcdnError as exc:
            raise ValueError(f"kvcdn connector: {exc}") from None
        if not values["source"]:
            raise ValueError(
                "kvcdn connector: kv_connector_extra_config needs 'source', a directory or a "
                "storage URI of .kv artifacts"
            )
        min_tokens = block_size if values["min_tokens"] is None else values["min_tokens"]
        return cls(values["source"], values["save"], min_tokens)
