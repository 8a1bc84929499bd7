"""kvcdn model family: Kyutai Helium (``HeliumForCausalLM``).

Helium is a Llama-layout full-attention decoder.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family helium``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class HeliumAdapter(TinyDecoderFamily):
    family = "helium"
    tiny_changes = {
        "HeliumForCausalLM": {},
    }
    validation_variants = {
        "HeliumForCausalLM": [dict(_variant="mha", num_key_value_heads=4)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[HeliumAdapter]]:
    return [HeliumAdapter]
