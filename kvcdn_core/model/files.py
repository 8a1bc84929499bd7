"""Finding a model's files (local path or Hugging Face id) and fingerprinting them.

The fingerprint is what ties an artifact to a model: the sha256 of the canonical ``config.json``
(volatile keys removed) and of the tokenizer. It is computed from files alone, so ``search`` can
check it with no weights and no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from kvcdn_core.atomic import atomic_open
from kvcdn_core.errors import KvcdnError, interruption
from kvcdn_core.paths import cache_home

#: config.json keys that change with the writer, not with the model.
VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_commit_hash",
    "use_cache",
    "_attn_implementation_autoset",
    "_attn_implementation",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
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
        interrupted = interruption(exc)
        if interrupted is not None:  # a Ctrl-C inside the hub client is still an interrupt
            raise interrupted from None
        raise KvcdnError(hub_failure(exc, ref, revision)) from None


def hub_failure(exc: Exception, ref: str, revision: str | None) -> str:
    """One human line for a failed hub download (the library's own text is long and technical)."""
    from huggingface_hub import errors

    cached = "not in the local Hugging Face cache"
    hint = "pass --model with a local model directory, or try again online"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            return f"model '{ref}' is {cached} and HF_HUB_OFFLINE is set: {hint}"
        return f"the Hugging Face hub is unreachable (offline?) and model '{ref}' is {cached}: {hint}"
    if isinstance(exc, errors.GatedRepoError):
        return f"model '{ref}' is gated on the Hugging Face hub: accept its terms and log in (hf auth login)"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"no model '{ref}' on the Hugging Face hub (or it is private: log in with hf auth login)"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"model '{ref}' has no revision '{revision}' on the Hugging Face hub"
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"cannot get model '{ref}' from the Hugging Face hub or its cache: {detail}"


def read_config(model_dir: Path) -> dict:
    """A model folder's ``config.json``; a missing or broken one is a one-line error."""
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvcdnError(f"cannot read {model_dir / 'config.json'}: {exc}") from None


def architecture_of(config: dict) -> str:
    """The architecture kvcdn dispatches on: the first entry of the config's ``architectures``."""
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


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def weights_sha256(model_dir: Path) -> str | None:
    """sha256 over the weight files' names and contents; None when the directory has no weights.

    Two models with the same config and tokenizer but other weights (a fine-tune, another seed)
    give different caches, so an artifact records this too. Files in the Hugging Face cache are
    links to blobs named by their sha256, which costs nothing to read; other files are hashed once
    and remembered by path, size and modification time.
    """
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in model_dir.glob(pattern) if f.is_file()})
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + _file_sha256(f).encode())
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    real = path.resolve()
    if path.is_symlink() and _SHA256_NAME.fullmatch(real.name):
        return real.name
    st = real.stat()
    store = cache_home() / "file-sha256.json"
    try:
        known = json.loads(store.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    hit = known.get(str(real)) if isinstance(known, dict) else None
    if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return str(hit.get("sha256"))
    digest = hashlib.sha256()
    with open(real, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    value = digest.hexdigest()
    known = known if isinstance(known, dict) else {}
    known[str(real)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": value}
    try:
        with atomic_open(store, text=True) as fh:
            json.dump(known, fh)
    except OSError:
        pass  # a cache that cannot be written only costs time
    return value


#: What makes an artifact usable with a model: the token ids mean the same (tokenizer) and the
#: cache has the same layout (architecture, config). ``weights_sha256`` is compared when both sides
#: know it (a tokenizer-only search does not).
COMPATIBILITY_KEYS = ("architecture", "config_sha256", "tokenizer_sha256")


def fingerprint(model_dir: Path, weights: bool = True) -> dict:
    """``{architecture, config_sha256, tokenizer_sha256, weights_sha256}`` of a model directory."""
    config = read_config(model_dir)
    return {
        "architecture": architecture_of(config),
        "config_sha256": config_sha256(config),
        "tokenizer_sha256": tokenizer_sha256(model_dir),
        "weights_sha256": weights_sha256(model_dir) if weights else None,
    }


def fingerprint_differences(recorded: dict, actual: dict) -> list[str]:
    """The fingerprint parts in which an artifact's recorded model and a model differ."""
    keys = list(COMPATIBILITY_KEYS)
    if recorded.get("weights_sha256") and actual.get("weights_sha256"):
        keys.append("weights_sha256")
    return [k.replace("_sha256", "") for k in keys if recorded.get(k) != actual.get(k)]
