"""The connector's ``kv_connector_extra_config`` keys, declared once (:data:`SETTINGS`, which
docs/vllm.md shows) and checked once at engine start (no torch)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcdn_core import KvcdnError, cache_home, settings

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
        default_doc="required, unless `store` is given",
    ),
    settings.Setting(
        "store",
        "A kvcdn chunk store (docs/store.md) instead of `source`: a directory, `file://...`, `s3://bucket/prefix` "
        "or any backend that stores bytes, or the hosted service (`kvcdn://`, `kvcdn+https://host`). "
        "Each request's prompt is looked up in the store's prefix index (never a listing of the store); only the "
        "chunks the local tier lacks are fetched, and `save` puts only the chunks the store lacks, in the "
        "background.",
        flag="--store",
        default_doc="none",
    ),
    settings.Setting(
        "tier_memory_bytes",
        "With `store`: bytes of chunks kept in memory per worker (least recently used dropped first).",
        settings.integer(0),
        flag="--tier-memory-bytes",
        default_doc="1/8 of the machine's memory, at most 4 GiB",
    ),
    settings.Setting(
        "tier_disk_bytes",
        "With `store`: bytes of chunks kept on disk in `tier_directory` (least recently used dropped first; "
        "0: no disk level).",
        settings.integer(0),
        16 << 30,
        flag="--tier-disk-bytes",
        default_doc="17179869184 (16 GiB)",
    ),
    settings.Setting(
        "tier_directory",
        "With `store`: the directory of the disk level. Engines on one machine may share it: a chunk one "
        "fetches, the others read from disk (checked once each) instead of fetching it too; each counts the "
        "budget over the files it found at start, those it wrote and those it read that the others wrote.",
        flag="--tier-directory",
        default_doc="`$XDG_CACHE_HOME/kvcdn/vllm-tier/`",
    ),
    settings.Setting(
        "tier_write_queue_bytes",
        "With `store`: bytes of fetched chunks waiting for their disk copy at most (one background thread "
        "writes them, so a load never waits for the disk); a chunk fetched while the queue is full stays in "
        "memory only, with one warning line per run.",
        settings.integer(1),
        1 << 30,
        flag="--tier-write-queue-bytes",
        default_doc="1073741824 (1 GiB)",
    ),
    settings.Setting(
        "save_queue",
        "With `store` and `save`: prompts waiting to be put into the store at most; when it is full, a new "
        "save is skipped with one warning line (the forward pass never waits for the store).",
        settings.integer(1),
        4,
        flag="--save-queue",
    ),
    settings.Setting(
        "save",
        "`true`: write each prompt that no artifact holds yet as an artifact in `source` (`vllm-<hash of its "
        "token ids>.kv`), in the step that computes its last prompt token; with `store`, put it into the store "
        "(as `vllm-<hash>`, only the chunks the store lacks, in the background). Under tensor parallelism the "
        "first worker saves every worker's heads, the artifact one worker alone would save; under pipeline "
        "parallelism saving is off (with one warning).",
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
    ``min_tokens``: neither load nor save prefixes shorter than this (default: one block); ``store``
    (instead of ``source``): a chunk store, with its local tier's budgets and the save queue."""

    source: str | None
    save: bool
    min_tokens: int
    store: str | None = None
    tier_memory_bytes: int = 0
    tier_disk_bytes: int = 0
    tier_directory: str | None = None
    save_queue: int = 4
    tier_write_queue_bytes: int = 1 << 30

    @classmethod
    def parse(cls, extra: dict[str, Any] | None, block_size: int) -> Settings:
        extra = dict(extra or {})
        try:
            settings.check_keys(extra, SETTINGS, LABEL)
            values, _ = settings.resolve(SETTINGS, file_values=extra, file_path=LABEL, environ={}, file_label=LABEL)
        except KvcdnError as exc:
            raise ValueError(f"kvcdn connector: {exc}") from None
        if bool(values["source"]) == bool(values["store"]):
            raise ValueError(
                "kvcdn connector: kv_connector_extra_config needs 'source', a directory or a "
                "storage URI of .kv artifacts, or 'store', a chunk store (one of the two)"
            )
        min_tokens = block_size if values["min_tokens"] is None else values["min_tokens"]
        if not values["store"]:
            return cls(values["source"], values["save"], min_tokens)
        memory = values["tier_memory_bytes"]
        return cls(
            None,
            values["save"],
            min_tokens,
            values["store"],
            default_memory_bytes() if memory is None else memory,
            values["tier_disk_bytes"],
            values["tier_directory"] or str(cache_home() / "vllm-tier"),
            values["save_queue"],
            values["tier_write_queue_bytes"],
        )


def default_memory_bytes() -> int:
    """An eighth of the machine's memory, at most 4 GiB: the engine's own cache needs the rest."""
    import os

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return min(total // 8, 4 << 30)
