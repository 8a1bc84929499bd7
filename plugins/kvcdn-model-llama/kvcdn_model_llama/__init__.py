"""kvcdn model family: Llama (Llama 2, 3, 3.1, 3.2, Yi and SmolLM2 checkpoints published as Llama)
and the Llama-layout decoders SmolLM3 (no rotary on every fourth layer) and Arcee AFM (ReLU² MLP).

Llama models use the standard transformers ``DynamicCache`` of full-attention layers, so the base
adapter exports and imports the cache; this plugin names the architecture and its tiny validation
configs. RoPE scaling: ``linear``, ``llama3`` and ``yarn`` rotate a position the same way at any
sequence length, so a cache continues exactly; ``dynamic`` (NTK) and ``longrope`` depend on the
sequence length and are kept exact or refused by core (``kvcdn_core.model.rope_regime``).

transformers has no ``YiForCausalLM`` class: Yi checkpoints on the hub declare
``LlamaForCausalLM`` and are served by this adapter; the early remote-code ``YiForCausalLM``
checkpoints are not.
"""

from kvcdn_core import TINY_DECODER, TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


#: Llama 3.1-style RoPE scaling, its original context shrunk below the validation context so the
#: scaled and unscaled frequency bands both matter.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


class LlamaAdapter(TinyDecoderFamily):
    family = "llama"
    tiny_base = dict(TINY_DECODER, _bos=True)
    tiny_changes = {
        "LlamaForCausalLM": {},
        "SmolLM3ForCausalLM": dict(num_hidden_layers=4, no_rope_layer_interval=2),
        "ArceeForCausalLM": dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    }
    validation_variants = {
        # Llama 3.1 RoPE scaling at 8 query heads per key-value head (Llama 3 70B); SmolLM2-135M's
        # 9:3 heads of width 64 with tied embeddings is validated on its real weights in the tests.
        "LlamaForCausalLM": [
            dict(
                _variant="llama3-rope-8q-kv1",
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=8,
                rope_parameters=dict(LLAMA3_ROPE),
            ),
            dict(_variant="mha-tied-wide-heads", num_key_value_heads=4, head_dim=32, tie_word_embeddings=True),
        ],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[LlamaAdapter]]:
    return [LlamaAdapter]
