"""What a benchmark run measures: its lengths, schemes, context token ids and torch threads,
each checked before anything is timed."""

from __future__ import annotations

from kvcdn_core.cores import physical_cores
from kvcdn_core.errors import KvcdnError


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise KvcdnError(f"--lengths must be comma-separated token counts, got '{text}'") from None
    if not lengths or lengths[0] < 1:
        raise KvcdnError(f"--lengths must be positive token counts, got '{text}'")
    return lengths


def parse_schemes(text: str, installed: list[str]) -> list[str]:
    """``none`` plus installed quantizer schemes; anything else is refused, naming what exists."""
    schemes = []
    for part in text.split(","):
        name = part.strip()
        if name and name not in schemes:
            schemes.append(name)
    if not schemes:
        raise KvcdnError("--scheme needs at least one scheme, e.g. none")
    unknown = [s for s in schemes if s != "none" and s not in installed]
    if unknown:
        have = ", ".join(["none", *sorted(installed)])
        raise KvcdnError(f"unknown quantization scheme(s) {', '.join(unknown)}; installed: {have}")
    return schemes


def installed_schemes() -> list[str]:
    from kvcdn_core.plugin_host.registry import quantizer_classes

    return sorted(quantizer_classes())


def check_lengths(session, lengths: list[int]) -> None:
    """Refuse lengths beyond the model's context window before anything is built."""
    longest = max(lengths)
    limit = getattr(session.model.config, "max_position_embeddings", None)
    if limit and longest > limit:
        raise KvcdnError(f"--lengths goes to {longest} tokens, the model's context is {limit}")


def context_ids(session, text: str | None, longest: int) -> tuple[list[int], str]:
    """Token ids covering ``longest`` tokens and a description of where they came from.

    Without a context file the sample text of the tiny models is repeated until it is long enough:
    prefill cost depends on the length, not the words, but say so in the output.
    """
    adapter, tok = session.adapter, session.tokenizer
    if text is not None:
        ids = adapter.encode_context(tok, text)
        if len(ids) < longest:
            raise KvcdnError(
                f"the context file has {len(ids)} tokens, --lengths needs {longest}; "
                "pass a longer file or smaller lengths"
            )
        return ids, f"context file ({len(ids)} tokens)"
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    once = max(len(adapter.encode_continuation(tok, SAMPLE_TEXT)), 1)
    text = SAMPLE_TEXT * (longest // once + 2)
    ids = adapter.encode_context(tok, text)
    return ids, f"synthetic: the built-in sample text repeated to {len(ids)} tokens (no --context-file)"


def set_threads(threads: int | None) -> int:
    """Pin torch's intra-op threads (default: the physical cores); return the number used.

    More torch threads than physical cores make CPU timings swing (siblings and other processes
    preempt a thread the others wait for)."""
    import torch

    threads = threads or physical_cores()
    if threads < 1:
        raise KvcdnError("--threads must be at least 1")
    torch.set_num_threads(threads)
    return torch.get_num_threads()
