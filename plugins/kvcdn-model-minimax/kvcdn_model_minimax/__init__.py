"""kvcdn model family: MiniMax-M2 (``MiniMaxM2ForCausalLM``) and MiniMax-Text-01 (``MiniMaxForCausalLM``).

MiniMax-M2 is a full-attention mixture of experts with QK norms and partial rotary embeddings.
A plain ``DynamicCache``: the base adapter does the work (``kvcdn validate --family minimax``).
MiniMax-Text-01 alternates lightning (linear) attention with softmax attention; its adapter is in
:mod:`kvcdn_model_minimax.lightning`.
"""

from kvcdn_core import ModelAdapter, TinyDecoderFamily, hookimpl
from kvcdn_model_minimax.lightning import LightningAdapter

__version__ = "0.1.0"


class MiniMaxAdapter(TinyDecoderFamily):
    family = "minimax"
    tiny_changes = {
        "MiniMaxM2ForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
    }
    validation_variants = {
        "MiniMaxM2ForCausalLM": [dict(_variant="12q-kv2", num_attention_heads=12, num_key_value_heads=2, head_dim=8)],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[ModelAdapter]]:
    return [MiniMaxAdapter, LightningAdapter]
