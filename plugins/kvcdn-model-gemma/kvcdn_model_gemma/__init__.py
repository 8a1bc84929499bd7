"""kvcdn model family: Gemma, Gemma 2 and Gemma 3 (the text-only ``Gemma3ForCausalLM``); Gemma 3n's
cross-layer KV sharing is :mod:`kvcdn_model_gemma.gemma3n`.

Gemma 2 and 3 interleave sliding-window layers with global ones (``layer_types``) and Gemma 2 caps
attention and final logits (softcapping). transformers builds a ``DynamicCache`` with one
sliding-window layer per local layer; the base adapter records each layer's kind, window and
cumulative length, so the artifact says exactly which layers are windowed. Softcapping acts on
logits, not on the cache, so nothing is stored for it; the validation configs turn it on so the
contract covers it. The tiny Gemma 2/3 configs untie the output embedding: tied, a random model
repeats one token, which would let a broken cache pass.
"""

from kvcdn_core import TINY_DECODER, ModelAdapter, TinyDecoderFamily, hookimpl
from kvcdn_model_gemma.gemma3n import Gemma3nAdapter
from kvcdn_model_gemma.recurrent import RecurrentGemmaAdapter

__version__ = "0.1.0"


class GemmaAdapter(TinyDecoderFamily):
    family = "gemma"
    tiny_base = dict(TINY_DECODER, _bos=True)
    tiny_changes = {
        "GemmaForCausalLM": dict(tie_word_embeddings=True),
        "Gemma2ForCausalLM": dict(
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        "Gemma3ForCausalLM": dict(
            num_hidden_layers=4,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            final_logit_softcapping=30.0,
        ),
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[ModelAdapter]]:
    return [GemmaAdapter, RecurrentGemmaAdapter, Gemma3nAdapter]
