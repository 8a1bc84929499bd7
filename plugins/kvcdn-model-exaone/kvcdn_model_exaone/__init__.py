"""kvcdn model family: LG AI EXAONE 4.0 (``Exaone4ForCausalLM``).

EXAONE 4.0 mixes sliding-window and global layers (hybrid attention) with QK norms; the global
layers have no rotary embedding.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family exaone``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class ExaoneAdapter(TinyDecoderFamily):
    family = "exaone"
    tiny_changes = {
        "Exaone4ForCausalLM": dict(
            num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"]
        ),
    }
    validation_variants = {
        "Exaone4ForCausalLM": [
            dict(_variant="8q-kv1-wide-heads", num_attention_heads=8, num_key_value_heads=1, head_dim=32)
        ],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[ExaoneAdapter]]:
    return [ExaoneAdapter]
