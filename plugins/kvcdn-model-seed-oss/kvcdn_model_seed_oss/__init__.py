"""kvcdn model family: ByteDance Seed-OSS (``SeedOssForCausalLM``).

Seed-OSS is full attention with attention biases on the query/key/value projections.

The cache is a standard transformers ``DynamicCache`` (full-attention and sliding-window layers),
which kvcdn's base adapter exports and imports; this plugin names the architectures and their tiny
validation shapes (``kvcdn validate --family seed-oss``).
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


class SeedOssAdapter(ModelAdapter):
    family = "seed-oss"
    architectures = ("SeedOssForCausalLM",)
    validation_configs = {
        "SeedOssForCausalLM": dict(_COMMON),
    }
    validation_variants = {
        "SeedOssForCausalLM": [dict(_variant="10q-kv2-wide-heads", num_attention_heads=10, head_dim=32)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [SeedOssAdapter]
