"""kvcdn model family: OpenAI gpt-oss (``GptOssForCausalLM``).

gpt-oss alternates sliding-window and global layers, uses attention sinks (a learned per-head
logit in the softmax, not cached) and a mixture of experts; its YaRN rotary is the same at any length.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family gptoss``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class GptOssAdapter(TinyDecoderFamily):
    family = "gptoss"
    tiny_changes = {
        "GptOssForCausalLM": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
    }
    validation_variants = {
        "GptOssForCausalLM": [dict(_variant="16q-kv2", num_attention_heads=16, num_key_value_heads=2, head_dim=8)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[GptOssAdapter]]:
    return [GptOssAdapter]
