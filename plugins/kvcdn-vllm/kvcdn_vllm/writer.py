"""Writing a prompt's cache, gathered from vLLM's blocks, as an ordinary kvcdn artifact.

The tensors are laid out as kvcdn's transformers runtime writes them (named by core's rule,
:func:`kvcdn_core.layer_tensor_name`: ``layers.<i>.key`` and ``layers.<i>.value`` of shape
``[1, kv_heads, tokens, head_size]``, and ``token_ids``), the manifest is core's
(:func:`kvcdn_core.runtime.model_manifest`: model id, revision, fingerprint, compute dtype, layers)
and core's writer adds the per-tensor sha256 and writes atomically. So ``kvcdn inspect --check``,
``kvcdn verify``, ``kvcdn search`` and another engine all accept the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import Any

import torch

from kvcdn_core import LayerEntry, artifact, layer_tensor_name


def artifact_name(prompt_ids: list[int]) -> str:
    """A stable file name per prompt: saving the same prompt twice replaces one file."""
    digest = hashlib.sha256(torch.tensor(prompt_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()
    return f"vllm-{digest[:20]}.kv"


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """What a saved artifact's manifest says of the engine's model (plain data: the save process
    gets it once, and never imports vLLM)."""

    model: str  # vLLM's model id
    revision: str | None
    model_dir: str  # its files: the tokenizer behind the artifact's prompt text
    fingerprint: dict[str, Any]
    vllm_version: str | None

    @classmethod
    def of_engine(cls, vllm_config: Any, model_dir: Path, fingerprint: dict[str, Any]) -> SavedModel:
        mc = vllm_config.model_config
        return cls(mc.model, mc.revision, str(model_dir), fingerprint, _vllm_version())


def write_prompt_artifact(
    directory: Path,
    model: SavedModel,
    prompt_ids: list[int],
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> Path:
    """Write ``layers`` (index → keys, values ``[kv_heads, tokens, head_size]``) as an artifact."""
    from kvcdn_core import runtime

    tensors: dict[str, torch.Tensor] = {}
    entries = []
    dtype = None
    for index in sorted(layers):
        keys, values = layers[index]
        dtype = keys.dtype
        names = {role: layer_tensor_name(index, role) for role in ("key", "value")}
        tensors[names["key"]] = keys.unsqueeze(0)
        tensors[names["value"]] = values.unsqueeze(0)
        entries.append(LayerEntry(index, artifact.FULL_ATTENTION, names))
    tensors[artifact.TOKEN_IDS] = torch.tensor(prompt_ids, dtype=torch.long)
    manifest = runtime.model_manifest(
        model.model,
        model.revision,
        _family(model.fingerprint),
        model.fingerprint,
        str(dtype).removeprefix("torch."),
        entries,
        _context(Path(model.model_dir), prompt_ids),
    )
    manifest["producer"] = {"engine": "vllm", "version": model.vllm_version}
    return artifact.write_artifact(Path(directory) / artifact_name(prompt_ids), manifest, tensors)


def _family(fingerprint: dict) -> str | None:
    """The kvcdn family plugin that serves the architecture, when one is installed."""
    from kvcdn_core import KvcdnError, adapter_for

    try:
        return adapter_for(fingerprint["architecture"]).family
    except KvcdnError:
        return None


def _context(model_dir: Path, prompt_ids: list[int]) -> str | None:
    """The prompt as text, kept only when it encodes back to exactly these ids (search relies on it).

    Decoding and encoding a 2,048-token prompt takes milliseconds; loading the tokenizer takes a
    quarter of a second, so it is loaded once per model, not once per save.
    """
    tok = _tokenizer(Path(model_dir))
    if tok is None:
        return None
    try:
        text = tok.decode(prompt_ids)
        return text if tok(text)["input_ids"] == list(prompt_ids) else None
    except Exception:  # ids the tokenizer cannot decode
        return None


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: Path) -> Any:
    """The model's plain tokenizer (:class:`kvcdn_core.search.QueryTokenizer`), or None without one."""
    from kvcdn_core import search

    try:
        return search.QueryTokenizer(model_dir)
    except Exception:  # no tokenizer.json, or one the plain library cannot build
        return None


def _vllm_version() -> str | None:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return None
