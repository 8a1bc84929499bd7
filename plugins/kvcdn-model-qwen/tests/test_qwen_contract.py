import pytest
from kvcdn_model_qwen import QwenAdapter

from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.mark.parametrize("architecture", sorted(QwenAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(QwenAdapter, architecture, tmp_path)


def test_sliding_window_config_is_exact(tmp_path):
    """Qwen2 with use_sliding_window: a context longer than the window stays token-exact."""

    class SlidingQwen(QwenAdapter):
        validation_configs = {
            "Qwen2ForCausalLM": dict(
                QwenAdapter.validation_configs["Qwen2ForCausalLM"],
                use_sliding_window=True,
                sliding_window=24,
                max_window_layers=0,
                layer_types=["sliding_attention", "sliding_attention"],
            ),
        }

    assert_adapter_contract(SlidingQwen, "Qwen2ForCausalLM", tmp_path)
