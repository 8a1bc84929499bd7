"""A valid `.kv` artifact of any size, written in bounded memory and without torch.

Memory tests of whatever reads artifacts (the hosted server's confirm, ``inspect --check``) need
files of hundreds of megabytes to gigabytes; building them with torch tensors would hold the whole
cache in the test's own memory. Here each tensor's bytes repeat one pseudo-random block, are hashed
in a first pass (for the manifest's digests, which precede the data) and written in a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct

from kvcdn_core import artifact
from kvcdn_core.artifact import digests

#: Bytes of the repeated pseudo-random block.
BLOCK = 1 << 20
#: Full-attention layers (each a key and a value tensor) the data is spread over.
LAYERS = 4
#: Context tokens; a tensor is ``[1, 2, TOKENS, width]`` float32.
TOKENS = 16


def write_large_kv(path: str | os.PathLike, size: int, seed: int = 0, corrupt: bool = False) -> str:
    """Write an artifact of about ``size`` bytes to ``path``; return the file's sha256 (hex).

    ``corrupt``: one byte of the last tensor differs from what its manifest digest was computed on,
    so that a check reads the whole file and then refuses it.
    """
    row = 2 * TOKENS * 4  # bytes per unit of width
    width = max(1, size // (2 * LAYERS) // row)
    tensor_bytes = width * row
    block = random.Random(seed).randbytes(BLOCK)
    names = [artifact.layer_tensor_name(i, role) for i in range(LAYERS) for role in ("key", "value")]
    token_ids = struct.pack(f"<{TOKENS}q", *range(TOKENS))
    algorithm = digests.BY_FORMAT_VERSION[artifact.FORMAT_VERSION]

    def pieces(index: int):
        """Tensor ``index``'s bytes: the block, rotated per tensor, repeated."""
        turn = (index * 4099) % BLOCK
        pattern = block[turn:] + block[:turn]
        left = tensor_bytes
        while left:
            yield pattern[: min(left, BLOCK)]
            left -= min(left, BLOCK)

    table = {"token_ids": {"dtype": "I64", "shape": [TOKENS], algorithm: digests.hexdigest(algorithm, token_ids)}}
    layers = []
    for i, name in enumerate(names):
        h = digests.hasher(algorithm, threads=2)
        for piece in pieces(i):
            h.update(piece)
        table[name] = {"dtype": "F32", "shape": [1, 2, TOKENS, width], algorithm: h.hexdigest()}
    for i in range(LAYERS):
        layers.append(
            {"index": i, "kind": "full_attention", "tensors": {"key": names[2 * i], "value": names[2 * i + 1]}}
        )
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-01-01T00:00:00Z",
        "model": {"id": "example/large", "architecture": "Qwen3ForCausalLM", "family": "qwen"},
        "compute_dtype": "float32",
        "token_count": TOKENS,
        "layers": layers,
        "quantization": None,
        "tensors": table,
    }
    entries: dict = {
        "__metadata__": {
            artifact.META_FORMAT: artifact.FORMAT_NAME,
            artifact.META_VERSION: str(artifact.FORMAT_VERSION),
            artifact.META_MANIFEST: json.dumps(manifest, sort_keys=True),
        }
    }
    offset = 0
    order = sorted(table)  # the data region in name order, as safetensors writes it
    for name in order:
        spec = table[name]
        length = len(token_ids) if name == "token_ids" else tensor_bytes
        entries[name] = {"dtype": spec["dtype"], "shape": spec["shape"], "data_offsets": [offset, offset + length]}
        offset += length
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    whole = hashlib.sha256()
    with open(path, "wb") as out:

        def write(data: bytes) -> None:
            whole.update(data)
            out.write(data)

        write(struct.pack("<Q", len(header)) + header)
        for name in order:
            if name == "token_ids":
                write(token_ids)
                continue
            index = names.index(name)
            last = corrupt and index == len(names) - 1
            for piece in pieces(index):
                if last:
                    piece, last = bytes([piece[0] ^ 1]) + piece[1:], False
                write(piece)
    return whole.hexdigest()
