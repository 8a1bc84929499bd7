import pytest
from kvcdn_model_hunyuan import HunYuanAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", HunYuanAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(HunYuanAdapter, architecture, tmp_path)
