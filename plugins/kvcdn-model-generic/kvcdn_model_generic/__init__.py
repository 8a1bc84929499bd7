"""kvcdn generic adapter: serve a causal LM that no family plugin claims, only after it proved exact.

When ``kvcdn`` loads a model whose architecture no installed family claims, core asks this plugin
(hook ``kvcdn_adapt_unclaimed_architecture``). The guard:

1. refuses outright the architectures kvcdn knows it cannot continue exactly (:data:`REFUSED`);
2. otherwise shrinks the model's own ``config.json`` to a tiny model of the same class
   (:mod:`kvcdn_model_generic.shrink`), and runs kvcdn's round-trip, reference and cache validation
   phases on it with the base adapter, which knows full-attention, sliding-window and pure
   linear-attention cache layers (any other layer kind fails the round trip, nothing is written);
3. records the result per kvcdn version, transformers version and architecture in
   ``$XDG_CACHE_HOME/kvcdn/generic/`` so the check runs once, and serves the architecture only if
   every phase passed. A failed guard is a refusal naming the failed phase.

Artifacts written through it say ``family: generic`` (``kvcdn inspect`` shows it), and ``kvcdn
plugins`` lists this plugin as ``generic``. A family plugin that claims the architecture always wins.
"""

from __future__ import annotations

import datetime as _dt
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcdn_core import LinearAttentionLayers, ModelAdapter, hookimpl, note

__version__ = "0.1.0"

#: Phases the guard runs (kvcdn_core.exactness.architecture.PHASES names).
GUARD_PHASES = ("roundtrip", "reference", "cache")

#: Architectures transformers 5.24 ships that cannot be served exactly, and why (one line each).
REFUSED = {
    "LongcatFlashForCausalLM": "transformers 5.24's own forward crashes on its MLA attention "
    "(head-count mismatch), so there is no reference to be exact against",
    "RwkvForCausalLM": "RWKV keeps its recurrent state outside transformers' Cache API, so there is no "
    "cache object to save and restore",
}


class GenericAdapter(LinearAttentionLayers, ModelAdapter):
    """The base adapter under the name ``generic``: full-attention, sliding-window and linear-attention
    layers, the kinds kvcdn restores without model-specific code."""

    family = "generic"
    extra = "generic"


def adapter_class(architecture: str, tiny_config: dict[str, Any]) -> type[GenericAdapter]:
    """A generic adapter that claims one architecture, with its shrunk config for validation."""
    return type(
        f"Generic_{architecture}",
        (GenericAdapter,),
        {
            "architectures": (architecture,),
            "validation_configs": {architecture: tiny_config},
        },
    )


# -- the guard ------------------------------------------------------------------------------------


def record_path(architecture: str) -> Path:
    """Where the guard's verdict for ``architecture`` is kept (per kvcdn and transformers version)."""
    import transformers

    import kvcdn_core
    from kvcdn_core import cache_home

    versions = f"kvcdn-{kvcdn_core.__version__}-transformers-{transformers.__version__}"
    return cache_home() / "generic" / versions / f"{architecture}.json"


def read_record(architecture: str) -> dict[str, Any] | None:
    try:
        record = json.loads(record_path(architecture).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("passed"), bool) else None


def run_guard(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """Validate ``architecture`` on its shrunk config; return (and store) the verdict record."""
    from kvcdn_core import atomic_open, validate_tiny
    from kvcdn_model_generic.shrink import shrink

    tiny = shrink(config)
    cls = adapter_class(architecture, tiny)
    with tempfile.TemporaryDirectory(prefix="kvcdn-generic-") as tmp:
        try:
            results = validate_tiny(cls, architecture, Path(tmp), phases=GUARD_PHASES)
            phases = [{"phase": r.phase, "passed": r.passed, "detail": r.detail} for r in results]
        except Exception as exc:  # a config that does not even build is a failed guard
            phases = [{"phase": "load", "passed": False, "detail": f"{type(exc).__name__}: {exc}".splitlines()[0]}]
    import transformers

    record = {
        "architecture": architecture,
        "transformers": transformers.__version__,
        "passed": bool(phases) and all(p["passed"] for p in phases),
        "phases": phases,
        "tiny_config": tiny,
        "checked_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    with atomic_open(record_path(architecture), text=True) as fh:
        json.dump(record, fh, indent=2, default=str)
    return record


def verdict(
    architecture: str, config: dict[str, Any], say: Callable[[str], object] | None = None
) -> type[GenericAdapter] | str:
    """The adapter class for ``architecture`` if its guard passed, else the refusal line."""
    if architecture in REFUSED:
        return f"kvcdn cannot serve {architecture} exactly: {REFUSED[architecture]}"
    record = read_record(architecture)
    if record is None:
        (say or note)(
            f"{architecture}: no family plugin claims it; validating it on a tiny config of "
            "its own class (once per transformers version) ..."
        )
        record = run_guard(architecture, config)
    if record["passed"]:
        return adapter_class(architecture, record["tiny_config"])
    failed = next(p for p in record["phases"] if not p["passed"])
    return (
        f"no family plugin claims {architecture}, and the generic adapter's guard failed on a tiny "
        f"config of it ({failed['phase']}: {failed['detail']}); not served"
    )


@hookimpl
def kvcdn_adapt_unclaimed_architecture(architecture: str, config: dict[str, Any]) -> type[GenericAdapter] | str | None:
    if not architecture or not str(architecture).endswith(("ForCausalLM", "LMHeadModel")):
        return None  # not a causal LM: let core say that no plugin serves it
    import transformers

    if getattr(transformers, architecture, None) is None:
        return None  # not a transformers class (remote code, a typo): core's "no plugin serves it"
    return verdict(architecture, config)
