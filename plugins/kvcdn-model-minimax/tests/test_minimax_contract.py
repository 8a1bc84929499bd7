import pytest
from kvcdn_model_minimax import MiniMaxAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", MiniMaxAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(MiniMaxAdapter, architecture, tmp_path)
