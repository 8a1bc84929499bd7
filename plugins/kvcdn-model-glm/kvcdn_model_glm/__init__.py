"""kvcdn model family: GLM and GLM-4 (``GlmForCausalLM``, ``Glm4ForCausalLM``).

Both use partial rotary embeddings (half of each head is rotated) and a standard transformers
``DynamicCache`` of full-attention layers, so the base adapter does the export and import; this
plugin names the architectures and their tiny validation configs. The older ChatGLM checkpoints
(``ChatGLMModel``, remote code) are a different architecture and are not served.
"""

from kvcdn_core import hookimpl
from kvcdn_core import ModelAdapter

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
               tie_word_embeddings=False)


class GlmAdapter(ModelAdapter):
    family = "glm"
    architectures = ("GlmForCausalLM", "Glm4ForCausalLM")
    validation_configs = {
        "GlmForCausalLM": dict(_COMMON),
        "Glm4ForCausalLM": dict(_COMMON),
    }


@hookimpl
def kvcdn_register_model_adapters():
    return [GlmAdapter]
