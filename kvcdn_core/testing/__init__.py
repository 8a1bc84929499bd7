"""Helpers for testing kvcdn plugins: in-process registration and the contract suites.

- :func:`assert_adapter_contract` for model adapters, and :func:`assert_prefix_reuse` for prefix
  search over their artifacts,
- :func:`assert_quantizer_contract` for quantization schemes,
- :func:`assert_storage_contract` for storage backends.

The pytest fixtures in :mod:`kvcdn_core.testing.fixtures` load automatically wherever kvcdn is
installed (a ``pytest11`` entry point). A family plugin's test suite is typically::

    import pytest
    from kvcdn_core.testing import assert_adapter_contract
    from my_plugin import MyAdapter

    @pytest.mark.parametrize("architecture", sorted(MyAdapter.validation_configs))
    def test_contract(architecture, tmp_path):
        assert_adapter_contract(MyAdapter, architecture, tmp_path)
"""

from __future__ import annotations

from pathlib import Path


def assert_adapter_contract(adapter_cls, architecture: str, workdir: Path, n: int = 16) -> None:
    """The model-adapter contract, on the adapter's tiny config for ``architecture``.

    Every tensor round-trips bitwise through a `.kv` file, and continuing from the artifact is
    token-exact against a full prefill for ``n`` greedy tokens, on a context longer than any sliding
    window the model has.
    """
    from kvcdn_core.exactness.architecture import validate_tiny

    assert architecture in adapter_cls.architectures, f"{adapter_cls.__name__} does not claim {architecture}"
    results = validate_tiny(adapter_cls, architecture, Path(workdir), n=n)
    failed = [r for r in results if not r.passed]
    assert not failed, "; ".join(f"{r.phase}: {r.detail}" for r in failed)


def assert_chunked_prefill_exact(
    session, ids: list[int], chunk: int = 64, rtol: float = 1e-4, atol: float = 1e-4
) -> None:
    """A prefill of ``ids`` in ``chunk``-token pieces gives the one-pass cache (every exported
    tensor) and last logits, within float32 rounding: a state carried across chunks is not lost."""
    import torch

    from kvcdn_core import runtime

    one_cache, one_logits = runtime.prefill(session, ids, chunk=len(ids), progress=False)
    chunk_cache, chunk_logits = runtime.prefill(session, ids, chunk=chunk, progress=False)
    _, one = session.adapter.export_cache(session.model, one_cache)
    _, chunked = session.adapter.export_cache(session.model, chunk_cache)
    assert sorted(one) == sorted(chunked)
    for name in one:
        torch.testing.assert_close(chunked[name], one[name], rtol=rtol, atol=atol, msg=name)
    torch.testing.assert_close(chunk_logits, one_logits, rtol=rtol, atol=atol)


def assert_prefix_reuse(session, workdir: Path, n: int = 16) -> int:
    """Prefix search (``continue --dir``) over an artifact of ``session``'s model is exact.

    Saves a long document, then continues a prompt that shares only the first two thirds of it:
    search crops a croppable artifact (``any_prefix``) to the shared prefix and prefills the rest; a
    ``whole_prefix`` one cannot be cropped, so the prompt is prefilled from scratch. Either way the
    ``n`` greedy tokens must equal a full prefill's. Returns the tokens reused (0: from scratch).
    """
    from kvcdn_core import artifact, runtime, search
    from kvcdn_core.artifact.manifest import ANY_PREFIX
    from kvcdn_core.exactness.architecture import TINY_QUESTION, long_context

    document = long_context(160, session.tokenizer)
    path, ids = runtime.generate(session, document, Path(workdir) / "document.kv", progress=False)
    croppable = artifact.read_manifest(path)["reuse"] == ANY_PREFIX

    def fail(message: str) -> None:
        raise AssertionError(message)

    found = search.search(workdir, document[: len(document) * 2 // 3] + TINY_QUESTION, session.model_ref, warn=fail)
    found = found.retokenized(session.tokenizer, session.fingerprint)
    reused = search.prefill_reusing(session, found.ranking, found.query_ids)
    tokens = runtime.decode_from(session, reused.cache, reused.logits, n)[0]
    expected, _ = runtime.greedy(session, session.adapter.new_cache(session.model), found.query_ids, n)
    assert tokens == expected, f"continued from {reused.reused_tokens} reused tokens: {tokens} != {expected}"
    assert len(set(expected)) >= 4, f"degenerate reference output {expected}: the check would prove nothing"
    if croppable:
        assert 0 < reused.reused_tokens < len(ids), f"reused {reused.reused_tokens} of {len(ids)} tokens, not a crop"
    else:
        assert reused.path is None, "a whole-prefix artifact was reused for a prompt that shares only a part of it"
    return reused.reused_tokens


from kvcdn_core.testing.quantizer import assert_quantizer_contract  # noqa: E402
from kvcdn_core.testing.storage import assert_storage_contract  # noqa: E402

__all__ = [
    "assert_adapter_contract",
    "assert_chunked_prefill_exact",
    "assert_prefix_reuse",
    "assert_quantizer_contract",
    "assert_storage_contract",
]
