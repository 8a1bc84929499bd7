"""kvcdn model family: Cohere Command R and Command R7B / A (Cohere, Cohere 2).

Command R (``CohereForCausalLM``) is full attention with a logit scale and parallel attention/MLP blocks;
Command R7B and Command A (``Cohere2ForCausalLM``) interleave sliding-window layers (three per global
layer, the global ones without rotary embeddings).
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family cohere``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class CohereAdapter(TinyDecoderFamily):
    family = "cohere"
    tiny_changes = {
        "CohereForCausalLM": dict(logit_scale=0.5),
        "Cohere2ForCausalLM": dict(
            num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"]
        ),
    }
    validation_variants = {
        "CohereForCausalLM": [dict(_variant="mha-tied", num_key_value_heads=4, tie_word_embeddings=True)],
        "Cohere2ForCausalLM": [dict(_variant="8q-kv1", num_attention_heads=8, num_key_value_heads=1)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[CohereAdapter]]:
    return [CohereAdapter]
