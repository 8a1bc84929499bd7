import pytest
from kvcdn_model_deepseek import DeepseekAdapter

from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.mark.parametrize("architecture", sorted(DeepseekAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(DeepseekAdapter, architecture, tmp_path)
