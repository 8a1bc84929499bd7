"""A model's own config shrunk to a tiny float32 model of the same architecture class.

The guard validates the architecture, not the checkpoint: every switch of the real config (layer
types, RoPE scaling, sliding window, biases, norms, expert routing) is kept, and only sizes are
replaced by the tiny ones kvcdn's family configs use. A size this module does not know stays as it
is; if the result is too big or inconsistent to build, the guard fails and the model is refused.
"""

from __future__ import annotations

from typing import Any

#: Keys that describe the checkpoint or its tokenizer, not the architecture.
DROPPED = (
    "architectures",
    "_name_or_path",
    "auto_map",
    "quantization_config",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "model_type",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "tie_encoder_decoder",
    "use_cache",
    "id2label",
    "label2id",
    "initializer_range",
)  # the tiny builder sets a wide init so greedy output is not degenerate

#: size key → tiny value (set only where the real config has the key).
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "ffn_hidden_size": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
MAX_LAYERS = 4
TINY_HEADS = 4
TINY_WINDOW = 16


def shrink(config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for the architecture's config class: ``config`` at tiny sizes."""
    tiny = {k: v for k, v in config.items() if k not in DROPPED}
    for key, value in SIZES.items():
        if tiny.get(key) is not None:
            tiny[key] = value
    heads = tiny.get("num_attention_heads")
    if heads:
        kv = tiny.get("num_key_value_heads") or heads
        tiny["num_attention_heads"] = TINY_HEADS
        if "num_key_value_heads" in tiny:  # keep the kind of attention: MHA, GQA or MQA
            tiny["num_key_value_heads"] = TINY_HEADS if kv == heads else (1 if kv == 1 else 2)
    if tiny.get("sliding_window"):
        tiny["sliding_window"] = TINY_WINDOW
    layers = tiny.get("num_hidden_layers") or MAX_LAYERS
    types = tiny.get("layer_types")
    if isinstance(types, list) and types:
        tiny["layer_types"] = _keep_every_kind(types)
        tiny["num_hidden_layers"] = len(tiny["layer_types"])
    else:
        tiny["num_hidden_layers"] = min(int(layers), MAX_LAYERS)
    if "first_k_dense_replace" in tiny:
        tiny["first_k_dense_replace"] = min(int(tiny["first_k_dense_replace"] or 0), 1)
    tiny["tie_word_embeddings"] = False  # tied, a random tiny model repeats one token
    return tiny


def _keep_every_kind(types: list[str]) -> list[str]:
    """The first ``MAX_LAYERS`` layer types, extended so that every kind of the real model appears."""
    kept = list(types[:MAX_LAYERS])
    for kind in dict.fromkeys(types):
        if kind not in kept:
            kept.append(kind)
    return kept
