import pytest
from kvcdn_model_ernie import ErnieAdapter

from kvcdn_core.testing import assert_adapter_contract


@pytest.mark.parametrize("architecture", ErnieAdapter.architectures)
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(ErnieAdapter, architecture, tmp_path)
