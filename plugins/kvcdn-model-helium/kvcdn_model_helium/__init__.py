"""kvcdn model family: Kyutai Helium (``HeliumForCausalLM``).

Helium is a Llama-layout full-attention decoder.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family helium``).
"""

from kvcdn_core import TINY_DECODER as _COMMON
from kvcdn_core import ModelAdapter, hookimpl

__version__ = "0.1.0"


class HeliumAdapter(ModelAdapter):
    family = "helium"
    architectures = ("HeliumForCausalLM",)
    validation_configs = {
        "HeliumForCausalLM": dict(_COMMON),
    }
    validation_variants = {
        "HeliumForCausalLM": [dict(_variant="mha", num_key_value_heads=4)],
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [HeliumAdapter]
