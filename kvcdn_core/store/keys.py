"""Chain keys: what a chunk of a cache holds, named without its bytes.

A chunk's key hashes its parent's key and its own token ids, and the chain starts from a root that
hashes the model's compatibility fingerprint, the representation (compute dtype, quantization
scheme and parameters) and the chunk size. Equal keys therefore mean the same tokens after the same
prefix, for a model of the same layout, in the same representation: the chunk of one artifact
serves any prompt that starts with the same tokens. vLLM names its prefix-cache blocks the same
way (a block's hash chains its parent's), and so does LMCache with its chunk keys.

Keys reveal nothing of the tokens without the tokens (BLAKE3, 256 bits), which is why the hosted
lookup takes keys, never token ids. Pure Python and numpy: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import blake3
import numpy as np

from kvcdn_core.model.files import COMPATIBILITY_KEYS

#: Tokens per chunk. A multiple of the block sizes of the engines kvcdn loads into (vLLM: 16 on GPU,
#: 128 on CPU), so a chunk boundary is always a block boundary, and of the default residual window
#: of the quantizers (128 tokens; quantizer groups run along the head dimension, not tokens). 256 is
#: also LMCache's default: at 4k tokens an artifact is 16 chunks, so the index stays small, and a
#: chunk of a 0.6B model in float32 is about 60 MB, a good object size for S3.
CHUNK_TOKENS = 256
#: Tokens of a chunk's first block: the hosted index keys each chunk's first 16 tokens too (vLLM's
#: GPU block size), so a lookup narrows the next chunk's candidates to those sharing them.
BLOCK_TOKENS = 16
#: Bumped when the key derivation changes; part of every root.
KEY_VERSION = 1


def canonical_json(value: Any) -> bytes:
    """The one byte encoding hashed into keys: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def representation(compute_dtype: str, quantization: Mapping[str, Any] | None) -> dict[str, Any]:
    """The representation part of a root: compute dtype and the quantization (scheme and parameters).

    Only what decides the bytes of a chunk's tensors counts: for a quantized artifact its scheme and
    parameters, target and storage dtypes and block version; the per-layer records (measured
    errors, the source's creation time) do not.
    """
    quant = None
    if quantization:
        quant = {k: quantization.get(k) for k in ("version", "scheme", "parameters", "target_dtype", "storage_dtype")}
    return {"compute_dtype": compute_dtype, "quantization": quant}


def root_key(fingerprint: Mapping[str, Any], rep: Mapping[str, Any], chunk_tokens: int = CHUNK_TOKENS) -> str:
    """The root of every chain for one model layout and representation (hex BLAKE3).

    The model part is the compatibility fingerprint (architecture, config, tokenizer), as search
    compares: weights are checked when a cache is loaded, and chunk bytes are stored by their own
    digest, so a fine-tune sharing its base's config never shares the base's bytes.
    """
    model = {k: fingerprint.get(k) for k in COMPATIBILITY_KEYS}
    payload = {"v": KEY_VERSION, "model": model, "representation": dict(rep), "chunk_tokens": chunk_tokens}
    return blake3.blake3(b"kvcdn-chunk-root\0" + canonical_json(payload)).hexdigest()


def child_key(parent: str, ids: Sequence[int] | np.ndarray) -> str:
    """The key of a chunk holding ``ids`` after the chunk (or root) ``parent``.

    The parent is a fixed 32 bytes, then the ids as little-endian int64, so no two (parent, ids)
    pairs hash the same input. A last, partial chunk is keyed the same way by its fewer ids.
    """
    data = np.ascontiguousarray(np.asarray(ids, dtype="<i8")).tobytes()
    return blake3.blake3(bytes.fromhex(parent) + data).hexdigest()


def chain(root: str, ids: Sequence[int] | np.ndarray, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:
    """The keys of ``ids`` cut into chunks: one per full chunk, then one for a partial remainder."""
    ids = np.asarray(ids, dtype=np.int64)
    keys, parent = [], root
    for start in range(0, ids.size, chunk_tokens):
        parent = child_key(parent, ids[start : start + chunk_tokens])
        keys.append(parent)
    return keys


def full_chain(root: str, ids: Sequence[int] | np.ndarray, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:
    """The keys of the full chunks of ``ids`` only (what a prompt can be looked up by)."""
    ids = np.asarray(ids, dtype=np.int64)
    return chain(root, ids[: ids.size - ids.size % chunk_tokens], chunk_tokens)


def first_block(parent: str, chunk_ids: Sequence[int] | np.ndarray, block_tokens: int = BLOCK_TOKENS) -> str | None:
    """The key of a chunk's first ``block_tokens`` ids after ``parent`` (None when it holds fewer)."""
    ids = np.asarray(chunk_ids, dtype=np.int64)
    return child_key(parent, ids[:block_tokens]) if ids.size >= block_tokens else None


#: Bytes of a key kept in a lookup's ``steps``: enough to rank a handful of candidates (a wrong
#: rank only costs the client a second request; it checks the match itself).
STEP_BYTES = 4


def steps(parent: str | bytes, chunk_ids: Sequence[int] | np.ndarray, block_tokens: int = BLOCK_TOKENS) -> bytes:
    """The first :data:`STEP_BYTES` bytes of the key of a chunk's first ``block_tokens``, then
    ``2 * block_tokens``, ... ids after ``parent`` (as :func:`child_key` hashes them), one after
    another: a hosted lookup's server compares them with its candidates' to rank them to the block."""
    ids = np.ascontiguousarray(np.asarray(chunk_ids, dtype="<i8"))
    hasher = blake3.blake3(bytes.fromhex(parent) if isinstance(parent, str) else parent)
    out = []
    for start in range(0, ids.size - ids.size % block_tokens, block_tokens):
        hasher.update(ids[start : start + block_tokens].tobytes())
        out.append(hasher.copy().digest()[:STEP_BYTES])
    return b"".join(out)


def heads(parent: str | bytes, chunk_ids: Sequence[int] | np.ndarray, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The keys (raw 32 bytes) of a chunk's first 1, 2, ... ``block_tokens - 1`` ids after
    ``parent`` (fewer when it holds fewer), as :func:`child_key` hashes them: the hosted index keys
    the children of a node with many of them so, and a query sharing under ``block_tokens`` tokens
    with all of them sends its own to find those sharing the most."""
    ids = np.ascontiguousarray(np.asarray(chunk_ids, dtype="<i8")[: block_tokens - 1])
    hasher, out = blake3.blake3(bytes.fromhex(parent) if isinstance(parent, str) else parent), []
    for i in range(ids.size):
        hasher.update(ids[i : i + 1].tobytes())
        out.append(hasher.copy().digest())
    return out
