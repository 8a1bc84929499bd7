import pytest
from kvcdn_model_gpt import GptAdapter

from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.mark.parametrize("architecture", sorted(GptAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(GptAdapter, architecture, tmp_path)
