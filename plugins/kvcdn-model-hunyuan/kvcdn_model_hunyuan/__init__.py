"""kvcdn model family: Tencent Hunyuan dense (``HunYuanDenseV1ForCausalLM``).

Hunyuan's dense models are full attention with QK norms and dynamic-alpha rotary scaling in some
checkpoints (kept exact or refused by core, like every length-dependent RoPE).
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family hunyuan``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class HunYuanAdapter(TinyDecoderFamily):
    family = "hunyuan"
    tiny_changes = {
        "HunYuanDenseV1ForCausalLM": {},
    }
    validation_variants = {
        "HunYuanDenseV1ForCausalLM": [dict(_variant="8q-kv1", num_attention_heads=8, num_key_value_heads=1)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[HunYuanAdapter]]:
    return [HunYuanAdapter]
