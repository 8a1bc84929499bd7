import pytest
from kvcdn_model_cohere import CohereAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", CohereAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(CohereAdapter, architecture, tmp_path)
