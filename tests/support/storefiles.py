"""Synthetic `.kv` files of every layer kind, for the chunk store's tests and benchmark.

Random tensors of tiny shapes, written by the real writer (:func:`kvcdn_core.artifact.write_artifact`),
so the store sees what a family plugin would write without loading a model. ``prefix_of`` makes an
artifact that continues another's first tokens with the *same bytes*, as a cache continued from a
cached prefix has.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvcdn_core import artifact

#: kind → (layer entry fields, role → shape with ``T`` for the token axis)
KINDS = {
    "full_attention": ({}, {"key": (1, 2, "T", 8), "value": (1, 2, "T", 8)}),
    "sliding_window": (
        {"window": 64, "cumulative_length": "T"},
        {"key": (1, 2, 64, 8), "value": (1, 2, 64, 8)},
    ),
    "mla_latent": ({}, {"latent": (1, 1, "T", 8), "rotary_key": (1, 1, "T", 4)}),
    "mla_indexed": (
        {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "index_head_dim": 6},
        {"latent": (1, 1, "T", 8), "rotary_key": (1, 1, "T", 4), "indexer_key": (1, "T", 6)},
    ),
    "linear_attention": ({}, {"conv_state": (1, 16, 4), "recurrent_state": (1, 4, 8, 8)}),
    "recurrent_state": ({}, {"conv_state": (1, 16, 4), "recurrent_state": (1, 4, 8)}),
    "linear_and_full_attention": (
        {"conv_kernel": 4},
        {"key": (1, 2, "T", 8), "value": (1, 2, "T", 8), "conv_state": (1, 16, 4), "recurrent_state": (1, 4, 8, 8)},
    ),
}


def write_kinds(
    path: Path,
    kinds: list[str],
    tokens: int,
    seed: int = 0,
    prefix_of: dict | None = None,
    context: str | None = None,
    model: dict | None = None,
) -> dict:
    """Write an artifact with one layer per kind in ``kinds``; return its tensors.

    ``model``: the manifest's model fingerprint (default: a tiny Qwen3's).

    With ``prefix_of`` (the tensors of another artifact), every per-token tensor starts with that
    artifact's first tokens, bit for bit, and the token ids too.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {artifact.TOKEN_IDS: torch.randint(0, 50_000, (tokens,), generator=gen)}
    layers = []
    for i, kind in enumerate(kinds):
        fields, roles = KINDS[kind]
        entry = {"index": i, "kind": kind, **{k: tokens if v == "T" else v for k, v in fields.items()}, "tensors": {}}
        for role, shape in roles.items():
            name = f"layers.{i}.{role}"
            tensors[name] = torch.randn([tokens if d == "T" else d for d in shape], generator=gen)
            entry["tensors"][role] = name
        layers.append(entry)
    if prefix_of is not None:
        shared = prefix_of[artifact.TOKEN_IDS].numel()
        for name, t in tensors.items():
            old = prefix_of.get(name)
            if name == artifact.TOKEN_IDS:
                t[:shared] = old
            elif old is not None and t.dim() >= 2 and t.shape[-2] == tokens and old.shape[-2] == shared:
                t[..., :shared, :] = old
    manifest = {
        "kvcdn_version": "0.1.0",
        "created_at": "2026-12-01T00:00:00+00:00",
        "model": model or {"id": "example/tiny", "architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64},
        "compute_dtype": "float32",
        "layers": layers,
        "quantization": None,
        "context": context,
    }
    artifact.write_artifact(path, manifest, tensors)
    return tensors


def churn(backend, paths: dict, deleted: set, rounds: int = 3, collectors: int = 2, gcs: int = 6) -> list:
    """Put, delete and collect at once over artifacts that share chunks: one thread per artifact puts
    it ``rounds`` times (deleting it after every round but the last, and after the last too when it
    is in ``deleted``) while ``collectors`` threads each run ``gcs`` collections. Returns the errors."""
    import threading

    from kvcdn_core.store.chunkstore import ChunkStore

    errors: list[BaseException] = []
    start = threading.Barrier(len(paths) + collectors)

    def worker(name):
        try:
            store = ChunkStore(backend)
            start.wait()
            for round_ in range(rounds):
                store.put(paths[name], name, force=True)
                if round_ < rounds - 1 or name in deleted:
                    store.delete(name)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    def collector():
        try:
            store = ChunkStore(backend)
            start.wait()
            for _ in range(gcs):
                store.gc()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in paths]
    threads += [threading.Thread(target=collector) for _ in range(collectors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


#: 8 full-attention layers: 1 KiB of cache per token, so the cache, not the token ids, dominates
CONVERSATION_KINDS = ["full_attention"] * 8


def conversation(tmp_path: Path, turns: int, seed: int = 0) -> list[Path]:
    """``turns`` artifacts, each continuing the previous one's tensors bitwise with 100-300 new tokens."""
    rng = random.Random(seed)
    paths: list[Path] = []
    tensors, tokens = None, 0
    for t in range(turns):
        tokens += rng.randint(100, 300)
        path = tmp_path / f"turn{t:02d}.kv"
        tensors = write_kinds(path, CONVERSATION_KINDS, tokens, seed=100 + t, prefix_of=tensors)
        paths.append(path)
    return paths


def layer_pieces(tensors: dict, cuts: tuple[int, ...] = ()) -> dict:
    """The full-attention layers of ``tensors`` (as :func:`write_kinds` returns them) as the vLLM
    connector hands a prompt to its save queue: layer index → ``(keys, values)`` pieces, each
    ``[kv_heads, tokens, head_size]``, cut at the token positions ``cuts``."""
    pieces = {}
    i = 0
    while f"layers.{i}.key" in tensors:
        keys, values = tensors[f"layers.{i}.key"][0], tensors[f"layers.{i}.value"][0]
        edges = [0, *cuts, keys.shape[1]]
        pieces[i] = [(keys[:, a:b], values[:, a:b]) for a, b in zip(edges, edges[1:])]
        i += 1
    return pieces
