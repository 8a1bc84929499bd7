"""kvcdn model family: Phi-3 / Phi-3.5 (``Phi3ForCausalLM``, LongRoPE) and Phi-1/1.5/2 (``PhiForCausalLM``).

Both use a standard transformers ``DynamicCache`` (full attention, or sliding-window layers when a
Phi-3 config sets ``sliding_window``), which the base adapter exports and imports. Phi-3's LongRoPE
switches every position from short to long rotation factors once a sequence passes
``original_max_position_embeddings``; core (``kvcdn_core.model.rope_regime``) recomputes the prefix when a
chunked prefill crosses that threshold, so an artifact equals a full prefill, and refuses to continue
a short-factor artifact past it. Phi-2 rotates only part of each head (``partial_rotary_factor``).
"""

from kvcdn_core import TinyDecoderFamily, hookimpl

__version__ = "0.1.0"

#: LongRoPE with an original context of 64 tokens: the validation context (over 96 tokens) is
#: prefilled in chunks of 64, so the prefill crosses the short→long switch. 8 = head_dim / 2.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0],
}


class PhiAdapter(TinyDecoderFamily):
    family = "phi"
    tiny_changes = {
        "Phi3ForCausalLM": dict(original_max_position_embeddings=64, rope_parameters=dict(LONGROPE)),
        "PhiForCausalLM": dict(partial_rotary_factor=0.5, qk_layernorm=True),
    }


@hookimpl
def kvcdn_register_model_adapters() -> list[type[PhiAdapter]]:
    return [PhiAdapter]
