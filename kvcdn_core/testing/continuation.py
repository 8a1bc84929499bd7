"""Continuing from a saved artifact against a full prefill, logit by logit.

For the tests of families whose cache carries a recurrent or linear-attention state: the adapter
contract compares greedy token ids; these helpers give the logits of a multi-token input fed on a
restored cache and on a full prefill of the same ids, so a test can bound the difference and show
that a broken state fails the same bound.
"""

from __future__ import annotations

from pathlib import Path

from kvcdn_core.artifact.manifest import manifest_of


def context_ids(session, n_tokens: int) -> list[int]:
    """Token ids of a repeat-free document of at least ``n_tokens`` tokens."""
    from kvcdn_core.exactness.architecture import long_context

    return session.adapter.encode_context(session.tokenizer, long_context(n_tokens, session.tokenizer))


def question_ids(session, text: str = " Which ship was missing, and where?") -> list[int]:
    """Token ids of a multi-token continuation."""
    ids = session.adapter.encode_continuation(session.tokenizer, text)
    assert len(ids) > 4, "the question must be several tokens long"
    return ids


def save_prefix(session, ids: list[int], path: Path, chunk: int = 64):
    """Prefill ``ids`` in chunks of ``chunk``, save the artifact and return its header."""
    from kvcdn_core import artifact, runtime

    cache, _ = runtime.prefill(session, ids, chunk=chunk, progress=False)
    return artifact.read_header(runtime.save_cache(session, cache, ids, "context", path))


def restored_and_full(session, header, question: list[int], cache=None):
    """Logits of ``question`` fed on the artifact's restored cache (or ``cache``, if given), and of
    the same positions in one full prefill of context ∥ question: ``(restored, full)``."""
    import torch

    from kvcdn_core import artifact, runtime

    ids = artifact.read_token_ids(header.path, header)
    if cache is None:
        cache, restored_ids = runtime.load_cache(session, header)
        assert restored_ids == ids
    adapter, model = session.adapter, session.model
    with torch.inference_mode():
        restored, _ = adapter.forward(model, torch.tensor([question]), cache)
        full, _ = adapter.forward(model, torch.tensor([ids + question]), adapter.new_cache(model))
    return restored, full[:, len(ids) :]


def assert_reusable_only_whole(session, header) -> None:
    """A restored cache of this artifact refuses a shorter prefix and is left as it was; its whole
    prefix is reused as is."""
    import pytest
    import torch

    from kvcdn_core import runtime
    from kvcdn_core.errors import KvcdnError

    restored, ids = runtime.load_cache(session, header)
    layers = manifest_of(header).layers
    assert header.manifest["reuse"] == "whole_prefix"
    state = next(layer for layer in layers if not layer.croppable)
    _, before = session.adapter.export_cache(session.model, restored)
    with pytest.raises(KvcdnError, match=f"layer {state.index} is '{state.kind}'"):
        session.adapter.crop(restored, layers, len(ids) - 3, token_count=len(ids))
    _, after = session.adapter.export_cache(session.model, restored)
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert session.adapter.crop(restored, layers, len(ids), token_count=len(ids)) is restored


def lost_state_error(session, header, question: list[int], full, layers: list[int]) -> float:
    """Max |Δlogit| against ``full`` of ``question`` fed on the restored cache after the recurrent
    states of ``layers`` were zeroed: what a cache that forgot its state would give (a control)."""
    from kvcdn_core import runtime

    broken, _ = runtime.load_cache(session, header)
    for index in layers:
        broken.layers[index].recurrent_states[0].zero_()
    wrong, _ = restored_and_full(session, header, question, cache=broken)
    return float((wrong - full).abs().max())


def assert_chunked_prefill_is_one_pass(session, n_tokens: int = 150, chunk: int = 64, atol: float = 1e-4) -> None:
    """Prefilling in chunks of ``chunk`` leaves the same cache tensors and last logits as one pass."""
    from kvcdn_core.testing import assert_chunked_prefill_exact

    assert_chunked_prefill_exact(session, context_ids(session, n_tokens), chunk=chunk, atol=atol)
