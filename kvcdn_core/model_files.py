"""Finding a model's files (local path or Hugging Face id) and fingerprinting them.

The fingerprint is what ties an artifact to a model: the sha256 of the canonical ``config.json``
(volatile keys removed) and of the tokenizer. It is computed from files alone, so ``search`` can
check it with no weights and no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvcdn_core.errors import KvcdnError

#: config.json keys that change with the writer, not with the model.
VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "use_cache",
    "_attn_implementation_autoset", "_attn_implementation", "output_attentions",
    "output_hidden_states", "return_dict",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
METADATA_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken"]


def resolve_model_dir(ref: str, revision: str | None = None, weights: bool = True) -> Path:
    """A local directory holding the model's files.

    A local path is used as it is; anything else is a Hugging Face id resolved through the standard
    cache (``HF_HUB_CACHE`` → ``$HF_HOME/hub`` → ``~/.cache/huggingface/hub``), downloading what is
    missing. ``weights=False`` fetches only config and tokenizer files.
    """
    local = Path(ref).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise KvcdnError(f"model directory '{ref}' has no config.json")
        return local.resolve()
    if ref.startswith((".", "/", "~")) or os.sep + os.sep in ref:
        raise KvcdnError(f"model path '{ref}' does not exist")
    try:
        from huggingface_hub import snapshot_download

        patterns = None if weights else METADATA_PATTERNS
        return Path(snapshot_download(ref, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated, bad revision
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvcdnError(
            f"cannot get model '{ref}' from the Hugging Face hub or its cache: {detail}. "
            "Pass --model with a local model directory when the hub is unreachable."
        ) from None


def read_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvcdnError(f"cannot read {model_dir / 'config.json'}: {exc}") from None


def architecture_of(config: dict) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise KvcdnError("config.json names no architectures; kvcdn dispatches on that field")
    return archs[0]


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def config_sha256(config: dict) -> str:
    stable = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(_canonical(stable)).hexdigest()


def tokenizer_sha256(model_dir: Path) -> str | None:
    """sha256 of the tokenizer's defining files; canonical JSON for ``tokenizer.json``."""
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        f = model_dir / name
        if not f.is_file():
            continue
        found = True
        digest.update(name.encode() + b"\0")
        data = f.read_bytes()
        if name.endswith(".json"):
            try:
                data = _canonical(json.loads(data))
            except ValueError:
                pass
        digest.update(data)
    return digest.hexdigest() if found else None


def fingerprint(model_dir: Path) -> dict:
    """``{architecture, config_sha256, tokenizer_sha256}`` of a model directory."""
    config = read_config(model_dir)
    return {
        "architecture": architecture_of(config),
        "config_sha256": config_sha256(config),
        "tokenizer_sha256": tokenizer_sha256(model_dir),
    }
