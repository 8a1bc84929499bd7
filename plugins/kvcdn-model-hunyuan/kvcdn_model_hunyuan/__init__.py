"""kvcdn model family: Tencent Hunyuan dense (``HunYuanDenseV1ForCausalLM``).

Hunyuan's dense models are full attention with QK norms and dynamic-alpha rotary scaling in some
checkpoints (kept exact or refused by core, like every length-dependent RoPE).

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family hunyuan``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class HunYuanAdapter(ModelAdapter):
    family = "hunyuan"
    architectures = ("HunYuanDenseV1ForCausalLM",)
    validation_configs = {
        "HunYuanDenseV1ForCausalLM": dict(_COMMON),
    }
    validation_variants = {
        "HunYuanDenseV1ForCausalLM": [dict(_variant="8q-kv1", num_attention_heads=8, num_key_value_heads=1)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [HunYuanAdapter]
