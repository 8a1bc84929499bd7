"""Helpers for testing kvcdn plugins: in-process registration and the contract suites.

- :func:`assert_adapter_contract` for model adapters,
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
    from kvcdn_core.validation import validate_tiny

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


from kvcdn_core.testing.quantizer import assert_quantizer_contract  # noqa: E402
from kvcdn_core.testing.storage import assert_storage_contract  # noqa: E402

__all__ = [
    "assert_adapter_contract",
    "assert_chunked_prefill_exact",
    "assert_quantizer_contract",
    "assert_storage_contract",
]
