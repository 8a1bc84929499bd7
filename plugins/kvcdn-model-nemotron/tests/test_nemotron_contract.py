import pytest
from kvcdn_model_nemotron import NemotronAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", NemotronAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(NemotronAdapter, architecture, tmp_path)
