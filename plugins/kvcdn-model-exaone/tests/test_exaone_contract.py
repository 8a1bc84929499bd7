import pytest
from kvcdn_model_exaone import ExaoneAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", ExaoneAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(ExaoneAdapter, architecture, tmp_path)
