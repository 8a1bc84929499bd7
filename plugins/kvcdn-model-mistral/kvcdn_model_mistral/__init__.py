"""kvcdn model family: Mistral (sliding-window attention) and Mixtral (sparse mixture of experts).

Mistral configs with ``sliding_window`` set get transformers' sliding-window cache layers, which keep
only the last ``window - 1`` keys and values; the base adapter stores the window and the cumulative
length so positions and the sliding mask continue correctly after a reload. Such an artifact can only
be reused as a whole (its cache cannot be cropped to a shorter prefix). Mixtral's experts change
nothing in the cache: it is a plain full-attention (or sliding) cache.
"""

from kvcdn_core import TINY_DECODER, TinyDecoderFamily, hookimpl

__version__ = "0.1.0"


class MistralAdapter(TinyDecoderFamily):
    family = "mistral"
    tiny_base = dict(TINY_DECODER, _bos=True)
    tiny_changes = {
        # A small window, so the validation context (2 x window + 8 tokens or more) crosses it.
        "MistralForCausalLM": dict(sliding_window=20),
        "MixtralForCausalLM": dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[MistralAdapter]]:
    return [MistralAdapter]
