import pytest
from kvcdn_model_gptoss import GptOssAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", GptOssAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(GptOssAdapter, architecture, tmp_path)
