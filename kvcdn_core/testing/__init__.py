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


from kvcdn_core.testing.quantizer import assert_quantizer_contract  # noqa: E402
from kvcdn_core.testing.storage import assert_storage_contract  # noqa: E402

__all__ = ["assert_adapter_contract", "assert_quantizer_contract", "assert_storage_contract"]
