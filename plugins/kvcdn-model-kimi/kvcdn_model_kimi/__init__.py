"""kvcdn model family: Kimi Linear (``KimiLinearForCausalLM``, Moonshot AI).

Kimi Linear interleaves Kimi Delta Attention (KDA, a gated delta rule with a per-channel decay) with
multi-head latent attention (MLA, DeepSeek's compressed cache, here without rotary positions).
transformers 5.24 gives it one cache layer per decoder layer: a pure linear-attention layer (the
short convolution over q, k, v and the delta-rule memory) for a KDA layer, a ``DynamicLayer`` holding
the MLA latent and the shared key part for a global layer. Both kinds are core's:
:class:`kvcdn_core.LinearAttentionLayers` records the first as ``linear_attention``, and
:class:`kvcdn_core.MlaLayers` the second as ``mla_latent``. The KDA state summarises the whole
prefix, so artifacts are reusable only as that prefix (cropping is refused). transformers' chunked
KDA kernel takes the saved state as its initial state on multi-token input, so chunked prefill and a
multi-token question on a restored cache are exact (``kvcdn validate --family kimi``).
"""

from kvcdn_core import TINY_DECODER, LinearAttentionLayers, MlaLayers, ModelAdapter, hookimpl

__version__ = "0.1.0"

#: TINY_DECODER's layout plus Kimi's own fields: MLA widths, KDA heads and kernel, experts.
#: Kimi derives ``head_dim`` from the rotary width itself; ``max_position_embeddings`` is its
#: ``model_max_length``.
_KIMI = dict(
    {k: v for k, v in TINY_DECODER.items() if k != "head_dim"},
    num_hidden_layers=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    # KDA, global, KDA, global: the real model's 3:1 ratio leaves a random tiny model's output
    # independent of the context (the variant below keeps it).
    layer_types=["linear_attention", "full_attention"] * 2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_shared_experts=1,
    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
)


class KimiAdapter(LinearAttentionLayers, MlaLayers, ModelAdapter):
    family = "kimi"
    architectures = ("KimiLinearForCausalLM",)
    validation_configs = {"KimiLinearForCausalLM": _KIMI}
    validation_variants = {
        "KimiLinearForCausalLM": [
            # Kimi-Linear-48B's pattern (three KDA layers, then a global one), compressed queries,
            # 8 query heads on a config that copies a GQA default of 2 key-value heads, a wider
            # rotary key and narrower value heads, tied embeddings.
            dict(
                _variant="3kda-1mla-8q-kv2",
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                mlp_layer_types=["dense"] + ["sparse"] * 3,
                num_attention_heads=8,
                num_key_value_heads=2,
                q_lora_rank=32,
                qk_rope_head_dim=16,
                v_head_dim=8,
                linear_num_heads=2,
                linear_head_dim=32,
                tie_word_embeddings=True,
            ),
        ],
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[KimiAdapter]]:
    return [KimiAdapter]
