"""kvcdn model family: ByteDance Seed-OSS (``SeedOssForCausalLM``).

Seed-OSS is full attention with attention biases on the query/key/value projections.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family seed-oss``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class SeedOssAdapter(TinyDecoderFamily):
    family = "seed-oss"
    tiny_changes = {
        "SeedOssForCausalLM": {},
    }
    validation_variants = {
        "SeedOssForCausalLM": [dict(_variant="10q-kv2-wide-heads", num_attention_heads=10, head_dim=32)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[SeedOssAdapter]]:
    return [SeedOssAdapter]
