"""kvcdn model family: OLMo, OLMo 2, OLMo 3, OLMoE, Granite, Granite MoE, StableLM and StarCoder2.

Open-weights decoder models whose caches are standard transformers ``DynamicCache`` layers: full
attention everywhere, plus sliding-window layers for StarCoder2 when its config sets
``sliding_window`` and for OLMo 3 (three windowed layers per global one). Their differences (QK norms, clipped QKV, Granite's multipliers, partial rotary
embeddings, biases, experts) live in the forward pass, not in the cache, so the base adapter exports
and imports them unchanged.
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class OlmoGraniteAdapter(TinyDecoderFamily):
    family = "olmo-granite"
    architectures = (
        "OlmoForCausalLM",
        "Olmo2ForCausalLM",
        "Olmo3ForCausalLM",
        "OlmoeForCausalLM",
        "GraniteForCausalLM",
        "GraniteMoeForCausalLM",
        "StableLmForCausalLM",
        "Starcoder2ForCausalLM",
    )
    tiny_changes = {
        "OlmoForCausalLM": dict(clip_qkv=8.0),
        "Olmo2ForCausalLM": {},
        "GraniteForCausalLM": dict(
            embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0
        ),
        "GraniteMoeForCausalLM": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            logits_scaling=2.0,
        ),
        "StableLmForCausalLM": dict(partial_rotary_factor=0.25, qk_layernorm=True, use_qkv_bias=True),
        "Starcoder2ForCausalLM": dict(sliding_window=24),
        "Olmo3ForCausalLM": dict(
            num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"]
        ),
        "OlmoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, clip_qkv=8.0),
    }
    validation_variants = {
        # OLMo 2 1B-style: equal head counts, YaRN-extended context.
        "Olmo2ForCausalLM": [
            dict(
                _variant="mha-yarn",
                num_key_value_heads=4,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            )
        ],
        "Olmo3ForCausalLM": [dict(_variant="8q-kv2", num_attention_heads=8, num_key_value_heads=2, head_dim=8)],
        "GraniteForCausalLM": [
            dict(_variant="8q-kv2-tied", num_attention_heads=8, head_dim=8, tie_word_embeddings=True)
        ],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[OlmoGraniteAdapter]]:
    return [OlmoGraniteAdapter]
