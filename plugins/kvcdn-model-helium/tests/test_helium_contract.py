import pytest
from kvcdn_model_helium import HeliumAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", HeliumAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(HeliumAdapter, architecture, tmp_path)
