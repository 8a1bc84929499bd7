"""Scheduler side: which artifact serves the longest prefix of a prompt, without importing torch.

kvcdn's search index (:mod:`kvcdn_core.search`) ranks the artifacts under the source directory by
common token prefix with the prompt, among those of the engine's model fingerprint. Before the
engine is told that tokens can be loaded, the chosen artifact is checked once per file version:
every layer is full attention (vLLM's paged cache can take any block-aligned prefix of such a cache),
the layer count and key/value shapes fit the engine's model, and every tensor's digest matches its
manifest. An artifact that fails is skipped with one warning line and the next best one is tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kvcdn_core import ArtifactError, KvcdnError, artifact, fingerprint_differences, manifest_of, search


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What an artifact's key/value tensors must look like to fit the engine's cache."""

    num_layers: int
    num_kv_heads: int
    head_size: int


@dataclasses.dataclass(frozen=True)
class Hit:
    """An artifact and the number of prompt tokens the engine may load from it (block-aligned)."""

    path: str
    tokens: int
    quantization: str | None


class Catalog:
    """Ranks the artifacts under ``directory`` for prompts of one model."""

    def __init__(self, directory: Path, fingerprint: dict, shape: ModelShape, warn: Callable[[str], None]):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.shape = shape
        self._warn = warn
        self._checked: dict[tuple, bool] = {}  # (path, size, mtime_ns, ino) → usable
        self._warned: set[str] = set()

    def best(self, prompt_ids: list[int], block_size: int, min_tokens: int) -> Hit | None:
        """The artifact that serves the most block-aligned prompt tokens, or None.

        Never all of the prompt: the engine computes at least its last token (it needs its logits).
        """
        try:
            entries = search.scan(self.directory, warn=self._warn_once)
        except KvcdnError as exc:
            self._warn_once(str(exc))
            return None
        for entry in entries:
            if not search.same_model(entry.model, self.fingerprint):
                parts = ", ".join(fingerprint_differences(entry.model, self.fingerprint))
                self._warn_once(f"skipping {entry.path}: made with another model ({parts} differ)")
        ranking = search.rank(entries, self.fingerprint, prompt_ids)
        for match in ranking.matches:
            tokens = match.usable_tokens // block_size * block_size
            if tokens < max(min_tokens, 1):
                break  # matches are sorted by usable tokens: no later one is longer
            if self._usable(match.entry):
                return Hit(str(match.path), tokens, match.entry.quantization)
        return None

    def holds(self, prompt_ids: list[int]) -> bool:
        """Whether an artifact of this model already holds the whole prompt (then saving is moot)."""
        try:
            entries = search.scan(self.directory, warn=self._warn_once)
        except KvcdnError:
            return False
        n = len(prompt_ids)
        return any(
            e.token_count >= n
            and search.same_model(e.model, self.fingerprint)
            and search.common_prefix(e.ids, prompt_ids) == n
            for e in entries
        )

    def _usable(self, entry: search.Entry) -> bool:
        key = (str(entry.path), entry.size, entry.mtime_ns, entry.ino)
        if key not in self._checked:
            try:
                self.check(artifact.read_header(entry.path))
                self._checked[key] = True
            except (ArtifactError, OSError) as exc:
                detail = str(exc).removeprefix(f"{entry.path}: ")
                self._warn_once(f"skipping {entry.path}: {detail}")
                self._checked[key] = False
        return self._checked[key]

    def check(self, header: artifact.Header) -> None:
        """Raise :class:`ArtifactError` unless the artifact fits the engine's paged cache."""
        check_fits(header, self.shape)

    def _warn_once(self, message: str) -> None:
        """The index rescans a bad file at every search; the log gets one line per problem."""
        if message not in self._warned:
            self._warned.add(message)
            self._warn(message)


def check_fits(header: artifact.Header, shape: ModelShape, hashes: bool = True) -> None:
    """Raise :class:`ArtifactError` unless the artifact fits the engine's paged cache (and, with
    ``hashes``, its tensors match their manifest digests; a chunk store checks its chunks itself)."""
    path, manifest = header.path, header.manifest
    typed = manifest_of(header)
    layers = typed.layers
    kinds = sorted({layer.kind for layer in layers} - {artifact.FULL_ATTENTION})
    if kinds:
        raise ArtifactError(f"{path}: has {', '.join(kinds)} layers; vLLM loads full-attention caches only")
    if len(layers) != shape.num_layers:
        raise ArtifactError(f"{path}: has {len(layers)} layers, the engine's model {shape.num_layers}")
    want = [shape.num_kv_heads, header.token_count, shape.head_size]
    quant = typed.quantization or {}
    for layer in layers:
        for part in ("key", "value"):
            name = layer.tensors.get(part)
            spec = manifest["tensors"].get(name) if name else None
            if quant:  # quantized tensors keep their original shape in the quantization record
                records = {r.get("index"): r for r in quant.get("layers", [])}
                spec = ((records.get(layer.index) or {}).get("tensors") or {}).get(part) or spec
            if spec is None or list(spec.get("shape", []))[-3:] != want:
                got = spec.get("shape") if spec else None
                raise ArtifactError(
                    f"{path}: layer {layer.index} {part} is {got}, the engine needs "
                    f"[1, {want[0]}, {want[1]}, {want[2]}]"
                )
    bad = artifact.check_hashes(header) if hashes else []
    if bad:
        raise ArtifactError(f"{path}: corrupted: {header.digest} mismatch in {len(bad)} tensor(s), first '{bad[0]}'")
