import pytest
from kvcdn_model_seed_oss import SeedOssAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", SeedOssAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(SeedOssAdapter, architecture, tmp_path)
