"""Validation of one architecture: the reference path, the cache path (save, load, continue) and
a bitwise round trip of every tensor. Shared by ``kvcdn validate`` and the contract test suite.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from kvcdn_core import artifact as fmt
from kvcdn_core import runtime
from kvcdn_core.runtime_defaults import DEFAULT_QUESTION


@dataclasses.dataclass
class PhaseResult:
    architecture: str
    phase: str  # roundtrip | cache | (quant schemes add their own)
    passed: bool
    detail: str = ""
    first_divergence: int | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def long_context(min_tokens: int, tokenizer) -> str:
    """Repeat-free text of at least ``min_tokens`` tokens, built from the sample text."""
    from kvcdn_core.tiny import SAMPLE_TEXT

    paragraphs = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < min_tokens:
        text += f"Section {i}. " + paragraphs[i % len(paragraphs)] + "\n\n"
        i += 1
    return text


def context_length_for(session) -> int:
    """Long enough to cross every sliding window the model has (and at least 96 tokens)."""
    cfg = session.model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None) or 0
    return max(96, int(window) * 2 + 8)


def compare_roundtrip(session, header) -> tuple[bool, str]:
    """Load the artifact, export the rebuilt cache again, and compare every tensor bitwise."""
    import torch

    stored = fmt.load_tensors(header)
    cache, _ = runtime.load_cache(session, header)
    _, again = session.adapter.export_cache(session.model, cache)
    for name, tensor in again.items():
        if name not in stored:
            return False, f"re-export produced unknown tensor {name}"
        if not torch.equal(stored[name].to(tensor.dtype), tensor.cpu()):
            return False, f"tensor {name} changed in the round trip"
    return True, f"{len(again)} tensors bitwise equal"


def validate_session(session, architecture: str, workdir: Path, n: int = 16,
                     context: str | None = None) -> list[PhaseResult]:
    from kvcdn_core.verify import run_verify

    results = []
    context = context or long_context(context_length_for(session), session.tokenizer)
    path = workdir / f"{architecture}.kv"
    start = time.perf_counter()
    runtime.generate(session, context, path, chunk=64, progress=False)
    header = fmt.read_header(path)
    ok, detail = compare_roundtrip(session, header)
    results.append(PhaseResult(architecture, "roundtrip", ok, detail, seconds=time.perf_counter() - start))
    start = time.perf_counter()
    res = run_verify(session, header, DEFAULT_QUESTION, n)
    results.append(PhaseResult(
        architecture, "cache", res.passed, f"token match {res.matches}/{res.n}, {res.context_tokens} context tokens",
        res.first_divergence, time.perf_counter() - start,
    ))
    return results


def validate_tiny(adapter_cls, architecture: str, workdir: Path, n: int = 16) -> list[PhaseResult]:
    """Build the adapter's tiny model for ``architecture`` and validate it offline."""
    from kvcdn_core.tiny import build_tiny_model

    model_dir = build_tiny_model(adapter_cls, architecture, workdir / architecture)
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    return validate_session(session, architecture, workdir, n)
