"""kvcdn model family: Llama (Llama 2, 3, 3.1, 3.2, and Yi checkpoints published as Llama).

Llama models use the standard transformers ``DynamicCache`` of full-attention layers, so the base
adapter exports and imports the cache. What this plugin adds is a guard on RoPE scaling: ``linear``
and ``llama3`` scaling are static (a position always gets the same rotation), so a cache continues
exactly; ``dynamic`` (NTK) scaling recomputes the frequencies from the current sequence length, so
keys cached before the sequence passed ``max_position_embeddings`` were rotated differently from a
full prefill. The adapter refuses that case with a clear error instead of producing a silently
different continuation.
"""

from kvcdn_core import hookimpl
from kvcdn_core.adapter import ModelAdapter
from kvcdn_core.errors import KvcdnError

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
               _bos=True)

#: Llama 3.1-style RoPE scaling, shrunk to the tiny model's context.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params if isinstance(params, dict) else {}


class LlamaAdapter(ModelAdapter):
    family = "llama"
    architectures = ("LlamaForCausalLM",)
    validation_configs = {
        "LlamaForCausalLM": dict(_COMMON),
    }

    def forward(self, model, input_ids, cache):
        if rope_parameters(model.config).get("rope_type") == "dynamic":
            limit = int(model.config.max_position_embeddings)
            cached = cache.get_seq_length()
            if cached and cached + input_ids.shape[-1] > limit:
                raise KvcdnError(
                    f"dynamic (NTK) RoPE scaling rescales every position once a sequence passes "
                    f"{limit} tokens, so a cache of {cached} tokens cannot be continued to "
                    f"{cached + input_ids.shape[-1]} tokens exactly; keep context and continuation "
                    f"within {limit} tokens"
                )
        return super().forward(model, input_ids, cache)


@hookimpl
def kvcdn_register_model_adapters():
    return [LlamaAdapter]
