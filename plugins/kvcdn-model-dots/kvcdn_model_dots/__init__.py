"""kvcdn model family: rednote dots.llm1 (``Dots1ForCausalLM``).

dots.llm1 is a DeepSeek-V3-style mixture of experts (a dense first layer, routed and shared experts)
over plain full attention with QK norms.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family dots``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class DotsAdapter(TinyDecoderFamily):
    family = "dots"
    tiny_changes = {
        "Dots1ForCausalLM": dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[DotsAdapter]]:
    return [DotsAdapter]
