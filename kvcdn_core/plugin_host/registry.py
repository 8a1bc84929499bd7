"""Lookup: the one place that asks the plugin host which class serves an architecture, a scheme or a URI.

Everything else in core (runtime, quantization, commands) and every plugin goes through these
functions, so the error a user sees when nothing is installed is worded once, here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from kvcdn_core.errors import KvcdnError
from kvcdn_core.plugin_host.manager import PluginHost, get_host

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvcdn_core.contracts.adapter import ModelAdapter
    from kvcdn_core.contracts.quantizer import Quantizer
    from kvcdn_core.contracts.storage import StorageBackend


def host() -> PluginHost:
    """The process-wide plugin host (created on first use)."""
    return get_host()


# -- model adapters ----------------------------------------------------------------------------


def adapter_classes() -> dict[str, type[ModelAdapter]]:
    """Architecture name (``config.json`` ``architectures``) → adapter class."""
    return get_host().model_adapters()


def families() -> dict[str, type[ModelAdapter]]:
    """Adapter family name → adapter class, for messages and ``kvcdn validate``."""
    return {cls.family: cls for cls in adapter_classes().values()}


def adapter_for(architecture: str, config: dict[str, Any] | None = None) -> type[ModelAdapter]:
    """The adapter class that claims ``architecture``, or an error naming what to install.

    With ``config`` (the model's ``config.json``), an architecture no family claims is offered to the
    ``kvcdn_adapt_unclaimed_architecture`` hook (the guarded generic adapter), which serves it,
    refuses it with a reason, or passes.
    """
    cls = adapter_classes().get(architecture)
    if cls is None and config is not None:
        for _name, offer in get_host().call_each(
            "kvcdn_adapt_unclaimed_architecture", architecture=architecture, config=config
        ):
            if isinstance(offer, str):
                raise KvcdnError(offer)
            if isinstance(offer, type):
                return offer
    if cls is None:
        installed = ", ".join(sorted(families())) or "none"
        raise KvcdnError(
            f"no installed kvcdn model plugin serves architecture '{architecture}' "
            f"(installed families: {installed}); install one, e.g. pip install 'kvcdn[{_guess_extra(architecture)}]'"
        )
    return cls


_EXTRA_HINTS = {
    # more specific prefixes first: the first match wins
    "gptoss": "gptoss",
    "granitemoehybrid": "hybrid",
    "jamba": "hybrid",
    "lfm2": "hybrid",
    "recurrentgemma": "gemma",
    "kimi": "kimi",
    "bamba": "hybrid",
    "falconh1": "hybrid",
    "zamba": "hybrid",
    "smollm": "llama",
    "arcee": "llama",
    "cohere": "cohere",
    "minimax": "minimax",
    "exaone": "exaone",
    "ernie": "ernie",
    "hunyuan": "hunyuan",
    "seedoss": "seed-oss",
    "dots": "dots",
    "helium": "helium",
    "nemotron": "nemotron",
    "qwen": "qwen",
    "llama": "llama",
    "yi": "llama",
    "mistral": "mistral",
    "mixtral": "mistral",
    "phi": "phi",
    "gemma": "gemma",
    "deepseek": "deepseek",
    "gpt": "gpt",
    "bloom": "gpt",
    "falcon": "gpt",
    "glm": "glm",
    "olmo": "olmo-granite",
    "granite": "olmo-granite",
    "stablelm": "olmo-granite",
    "starcoder": "olmo-granite",
    "mamba": "ssm",
}


def _guess_extra(architecture: str) -> str:
    lower = architecture.lower()
    if "mamba" in lower:
        return "ssm"
    for key, extra in _EXTRA_HINTS.items():
        if lower.startswith(key):
            return extra
    return "all"


# -- quantizers ----------------------------------------------------------------------------------


def quantizer_classes() -> dict[str, type[Quantizer]]:
    """Scheme name → quantizer class."""
    return get_host().quantizers()


def quantizer_for(scheme: str) -> type[Quantizer]:
    """The quantizer class of ``scheme``, or an error naming the installed schemes."""
    classes = quantizer_classes()
    cls = classes.get(scheme)
    if cls is None:
        hint = " (install it: pip install 'kvcdn[quant-lowbit]')" if scheme in ("int4", "int2") else ""
        raise KvcdnError(
            f"no installed quantizer provides scheme '{scheme}'{hint}; "
            f"installed schemes: {', '.join(sorted(classes)) or 'none'}"
        )
    return cls


def claim_note(kind: str, value: str) -> str:
    """What to append to an error about ``value`` (a scheme, architecture or URI scheme; ``kind`` is
    ``schemes``, ``architectures`` or ``uri_schemes``) when two plugins claim it: which one is used.
    An error from the winner's class then says that another plugin's artifact may need the loser."""
    contest = get_host().contenders(kind, value)
    if contest is None:
        return ""
    winner, losers = contest
    what = kind.rstrip("s").replace("_", " ")
    others = ", ".join(f"'{name}'" for name in losers)
    return (
        f" ({what} {value} is provided by plugin '{winner}'; plugin {others} also claims it and is not used;"
        " `kvcdn plugins` lists both)"
    )


# -- storage -------------------------------------------------------------------------------------


def storage_classes() -> dict[str, type[StorageBackend]]:
    """URI scheme → storage backend class."""
    return get_host().storage_backends()


def uri_scheme(uri: str) -> str:
    """The scheme that selects a storage backend: ``s3`` for ``s3://b/p``, ``file`` for a bare path."""
    return urlparse(uri).scheme if "://" in uri else "file"


def open_storage(uri: str) -> StorageBackend:
    """The backend for a URI: the class claiming its scheme, built by ``cls.from_uri(uri)``."""
    scheme = uri_scheme(uri)
    backends = storage_classes()
    cls = backends.get(scheme)
    if cls is None:
        known = ", ".join(sorted(backends)) or "none"
        raise KvcdnError(f"no storage backend for '{scheme}://' (installed: {known})")
    try:
        return cls.from_uri(uri)
    except KvcdnError as exc:
        # a URI scheme two plugins claim: the refusal says whose backend was used
        note = claim_note("uri_schemes", scheme)
        if not note:
            raise
        raise KvcdnError(f"{exc}{note}") from None


# -- commands ------------------------------------------------------------------------------------


def register_commands(cli: Any) -> None:
    """Let every plugin add its click commands to the ``kvcdn`` group."""
    get_host().register_commands(cli)
