import pytest
from kvcdn_model_dots import DotsAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", DotsAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(DotsAdapter, architecture, tmp_path)
