"""kvcdn model family: Llama (Llama 2, 3, 3.1, 3.2, and Yi checkpoints published as Llama).

Llama models use the standard transformers ``DynamicCache`` of full-attention layers, so the base
adapter exports and imports the cache; this plugin names the architecture and its tiny validation
configs. RoPE scaling: ``linear``, ``llama3`` and ``yarn`` rotate a position the same way at any
sequence length, so a cache continues exactly; ``dynamic`` (NTK) and ``longrope`` depend on the
sequence length and are kept exact or refused by core (``kvcdn_core.rope_regime``).

transformers has no ``YiForCausalLM`` class: Yi checkpoints on the hub declare
``LlamaForCausalLM`` and are served by this adapter; the early remote-code ``YiForCausalLM``
checkpoints are not.
"""

from kvcdn_core import hookimpl
from kvcdn_core import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
               _bos=True)

#: Llama 3.1-style RoPE scaling, its original context shrunk below the validation context so the
#: scaled and unscaled frequency bands both matter.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


class LlamaAdapter(ModelAdapter):
    family = "llama"
    architectures = ("LlamaForCausalLM",)
    validation_configs = {
        "LlamaForCausalLM": dict(_COMMON),
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [LlamaAdapter]
