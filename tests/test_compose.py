"""Composing cached documents out of prefix order (kvcdn_core.compose), float32 on tiny models.

Tolerances: float32 prefills of the same ids in a different split (one pass against chunks, a key
rotated twice against once) agree to a few ulp of the largest entry; 1e-4 relative is three orders
above what was measured (about 4e-6 at worst) and far below any real error (a key left at its old
position differs by order one).
"""

from __future__ import annotations

import pytest

from kvcdn_core import artifact, compose, runtime
from kvcdn_core.artifact.manifest import LayerEntry
from kvcdn_core.errors import KvcdnError
from kvcdn_core.model.mla import ungroup_mla_heads
from kvcdn_core.model.tiny import SAMPLE_TEXT, TINY_DECODER, config_variants, model_class
from kvcdn_core.plugin_host.registry import adapter_classes

TOL = 1e-4
DOCUMENTS = [p.strip() for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
QUESTION = "\n\nQ: Which ship was lost?\nA:"

#: One architecture per rotary layout the families use (half-split, interleaved, partial, NoPE layers).
FAMILIES = [
    "Qwen3ForCausalLM",
    "LlamaForCausalLM",
    "PhiForCausalLM",  # partial rotary, split by the attention
    "StableLmForCausalLM",  # partial rotary
    "GlmForCausalLM",  # partial and interleaved
    "CohereForCausalLM",  # interleaved
    "NemotronForCausalLM",  # partial, split inside apply_rotary_pos_emb
    "GPTNeoXForCausalLM",  # partial, another module layout
    "SmolLM3ForCausalLM",  # every other layer without rotary positions
    "Ernie4_5ForCausalLM",
    "DeepseekV2ForCausalLM",  # MLA, interleaved complex rotary key
    "DeepseekV3ForCausalLM",  # MLA, interleaved YaRN written half-split
    "DeepseekV32ForCausalLM",  # MLA with the DSA indexer key
    "GlmMoeDsaForCausalLM",  # MLA, DSA with layers sharing a selection
    "Qwen3_5ForCausalLM",  # multimodal rotary sections, interleaved, partial (full-attention layers only)
    "MistralForCausalLM",  # a sliding window on every layer (widened to hold the documents)
    "Gemma2ForCausalLM",  # sliding and full layers alternating (widened)
    "GptOssForCausalLM",  # sliding and full layers, attention sinks (widened)
    "Cohere2ForCausalLM",  # rotary on its sliding layers only (widened)
    "Exaone4ForCausalLM",  # likewise, by another rule (widened)
    "Gemma3ForCausalLM",  # rotary frequencies per layer type, local and global (widened)
    "Olmo3ForCausalLM",  # likewise (widened)
]

_ROPE = {"rope_theta": 10000.0}
#: Qwen3.5's rotary at tiny scale: half of the head rotary, its 4 frequency pairs
#: split 2:1:1 between the temporal, height and width positions, interleaved.
_MROPE = {**_ROPE, "rope_type": "default", "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
#: (architecture, variant, config changes): every rotary kind, as a model built in memory.
ROTARY_KINDS = {
    "plain": ("Qwen3ForCausalLM", None, {}),
    "linear": ("LlamaForCausalLM", None, {"rope_parameters": {**_ROPE, "rope_type": "linear", "factor": 4.0}}),
    "dynamic": ("LlamaForCausalLM", None, {"rope_parameters": {**_ROPE, "rope_type": "dynamic", "factor": 4.0}}),
    "yarn": (
        "LlamaForCausalLM",
        None,
        {
            "max_position_embeddings": 4096,
            "rope_parameters": {**_ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        },
    ),
    "llama3": ("LlamaForCausalLM", "llama3-rope-8q-kv1", {}),
    "longrope": ("Phi3ForCausalLM", None, {}),
    "partial": ("PhiForCausalLM", None, {}),
    "partial-interleaved": ("GlmForCausalLM", None, {}),
    "interleaved": ("CohereForCausalLM", None, {}),
    "partial-in-apply": ("NemotronForCausalLM", None, {}),
    "nope-layers": ("SmolLM3ForCausalLM", None, {}),
    "chunked-halves": ("GptOssForCausalLM", None, {}),
    "rope-on-sliding-only": ("Cohere2ForCausalLM", None, {"sliding_window": 64}),
    "rope-on-sliding-only-exaone": ("Exaone4ForCausalLM", None, {"sliding_window": 64}),
    "per-layer-type": ("Gemma3ForCausalLM", None, {"sliding_window": 64}),
    "per-layer-type-olmo": ("Olmo3ForCausalLM", None, {"sliding_window": 64}),
    "mrope-interleaved-partial": (
        "Qwen3_5ForCausalLM",
        None,
        {"layer_types": ["full_attention"] * 4, "rope_parameters": _MROPE},
    ),
}


_MSCALE_YARN = {
    **_ROPE,
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}
#: Multi-head latent attention: every layout of the cached rotary key and indexer key, and a YaRN
#: whose attention scaling is not 1 (mscale without mscale_all_dim), which must be divided out.
MLA_KINDS = {
    "v2-complex": ("DeepseekV2ForCausalLM", None, {}),
    "v2-complex-mscale": ("DeepseekV2ForCausalLM", None, {"rope_parameters": _MSCALE_YARN}),
    "v3-interleaved-yarn": ("DeepseekV3ForCausalLM", None, {}),
    "v3-half-split": ("DeepseekV3ForCausalLM", "no-q-lora", {}),
    "v3-mscale": ("DeepseekV3ForCausalLM", None, {"rope_parameters": _MSCALE_YARN}),
    "v32-indexer": ("DeepseekV32ForCausalLM", None, {}),
    "v32-indexer-yarn-grouped": ("DeepseekV32ForCausalLM", "8q-kv2-yarn", {}),
    "glm-dsa-shared": ("GlmMoeDsaForCausalLM", "8q-kv2-top8", {}),
}


def _model(architecture, variant, changes):
    import torch

    adapter = adapter_classes()[architecture]
    kwargs = dict(config_variants(adapter, architecture)[variant or "default"])
    kwargs.pop("_bos", None)
    kwargs.update(vocab_size=384, initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=1, **changes)
    cls = model_class(architecture)
    torch.manual_seed(0)
    model = cls(cls.config_class(**kwargs)).float().eval()
    ungroup_mla_heads(model)  # as the MLA adapters load them; no-op for other models
    return model


def _prefilled_at(model, ids, offset):
    """The cache of ``ids`` alone, at positions ``offset..``: what a moved cache must equal."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = torch.arange(offset, offset + ids.shape[1])[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
    return cache


def _relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", list(ROTARY_KINDS))
def test_a_moved_document_equals_its_prefill_at_the_new_offset(kind):
    """Rotary attention depends on relative positions only, so a document prefilled alone at offset
    p has, layer for layer, the keys of its offset-0 cache moved by p and the same values."""
    import torch

    model = _model(*ROTARY_KINDS[kind])
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(1))
    at_zero, at_p = _prefilled_at(model, ids, 0), _prefilled_at(model, ids, 23)
    rotated = compose.rotated_layers(model)
    checked = 0
    for i, (moved_from, want, has_rope) in enumerate(zip(at_zero.layers, at_p.layers, rotated)):
        if getattr(want, "keys", None) is None or want.keys.shape != moved_from.keys.shape:
            continue  # a sliding window shorter than the document (gpt-oss's): such compositions are refused
        keys = compose.move_keys(model, moved_from.keys, 23, i) if has_rope else moved_from.keys
        assert _relative(keys, want.keys) < TOL
        assert _relative(moved_from.values, want.values) < TOL
        # and the move is real: the unmoved keys are far off (order one)
        if has_rope:
            assert _relative(moved_from.keys, want.keys) > 1e-2
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("kind", list(MLA_KINDS))
def test_a_moved_mla_document_equals_its_prefill_at_the_new_offset(kind):
    """MLA: the latent carries no position and is the same at every offset; the rotary key, and the
    rotary channels of a DSA indexer key, are the offset-0 ones moved by p."""
    import torch

    model = _model(*MLA_KINDS[kind])
    if kind.endswith("mscale"):
        assert abs(model.model.rotary_emb.attention_scaling - 1.0) > 0.1
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(1))
    at_zero, at_p = _prefilled_at(model, ids, 0), _prefilled_at(model, ids, 23)
    indexed = 0
    for moved_from, want in zip(at_zero.layers, at_p.layers):
        assert _relative(moved_from.keys, want.keys) < TOL
        assert _relative(compose.move_mla_keys(model, moved_from.values, 23), want.values) < TOL
        assert _relative(moved_from.values, want.values) > 1e-2
        if getattr(want, "is_indexer_initialized", False):
            moved = compose.move_mla_keys(model, moved_from.indexer_keys, 23, indexer=True)
            assert _relative(moved, want.indexer_keys) < TOL
            assert _relative(moved_from.indexer_keys, want.indexer_keys) > 1e-2
            indexed += 1
    assert indexed >= (1 if "v32" in kind or "glm" in kind else 0)


@pytest.mark.parametrize("name", ["Qwen2VLTextModel", "Qwen2_5_VLTextModel", "Qwen3VLTextModel"])
def test_a_moved_document_equals_its_prefill_on_the_vision_language_text_stacks(name):
    """Qwen2-VL and 2.5-VL (sections in blocks) and Qwen3-VL (interleaved) text stacks: a text
    document moves like any rotary one. (kvcdn has no adapter for these yet; the rotation is the
    same code path as Qwen3.5's.) The sections are real: an image-like position (t, 0, 0) rotates
    differently from the text position t (equal sections)."""
    import torch
    import transformers
    from transformers import DynamicCache

    cls = getattr(transformers, name)
    config = cls.config_class(
        **dict(
            TINY_DECODER,
            vocab_size=384,
            bos_token_id=1,
            eos_token_id=1,
            rope_parameters={**_MROPE, "partial_rotary_factor": 1.0, "mrope_section": [4, 2, 2]},
        )
    )
    torch.manual_seed(0)
    model = cls(config).float().eval()
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(1))

    def prefilled_at(offset):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(offset, offset + 40)[None], cache=cache, use_cache=True)
        return cache

    for moved_from, want in zip(prefilled_at(0).layers, prefilled_at(23).layers):
        assert _relative(compose.move_keys(model, moved_from.keys, 23), want.keys) < TOL
        assert _relative(moved_from.keys, want.keys) > 1e-2
    text, _ = model.rotary_emb(torch.zeros(1), torch.tensor([[200]]))
    image, _ = model.rotary_emb(torch.zeros(1), torch.tensor([[[200]], [[0]], [[0]]]))
    assert float((text - image).abs().max()) > 0.1


class _Qwen35FullAttention(adapter_classes()["Qwen3_5ForCausalLM"]):
    """Qwen3.5's text model with full-attention layers only: its multimodal rotary sections, without
    the gated-DeltaNet layers that are refused for composition."""

    validation_configs = {
        "Qwen3_5ForCausalLM": dict(
            adapter_classes()["Qwen3_5ForCausalLM"].validation_configs["Qwen3_5ForCausalLM"],
            layer_types=["full_attention"] * 4,
            rope_parameters=_MROPE,
        )
    }


def _widened(architecture, window=512):
    """The architecture's adapter with a sliding window wide enough for the test documents (the
    tiny configs' 16-20 tokens hold none of them; those are refused, see below)."""
    base = adapter_classes()[architecture]
    configs = {architecture: dict(base.validation_configs[architecture], sliding_window=window)}
    return type(f"Widened{base.__name__}", (base,), {"validation_configs": configs})


#: Architectures composed with a test adapter instead of their own (whose layers are refused).
_ADAPTERS = {
    "Qwen3_5ForCausalLM": _Qwen35FullAttention,
    **{
        arch: _widened(arch)
        for arch in (
            "MistralForCausalLM",
            "Gemma2ForCausalLM",
            "GptOssForCausalLM",
            "Cohere2ForCausalLM",
            "Exaone4ForCausalLM",
            "Gemma3ForCausalLM",
            "Olmo3ForCausalLM",
        )
    },
}


@pytest.fixture(scope="module")
def family_artifacts(tiny_session, tmp_path_factory):
    """Factory ``(session, headers)``: the tiny model of an architecture and an artifact per document."""
    made = {}

    def get(architecture, documents=DOCUMENTS[:3], adapter=None):
        adapter = adapter or _ADAPTERS.get(architecture) or adapter_classes()[architecture]
        key = (architecture, tuple(documents), adapter)
        if key not in made:
            session = tiny_session(adapter, architecture)
            out = tmp_path_factory.mktemp(f"compose-{architecture}")
            headers = []
            for i, text in enumerate(documents):
                path, _ = runtime.generate(session, text, out / f"doc{i}.kv", progress=False)
                headers.append(artifact.read_header(path))
            made[key] = session, headers
        return made[key]

    return get


def _reference(session, ids, question_ids, n=8):
    return runtime.greedy(session, session.adapter.new_cache(session.model), ids + question_ids, n)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("architecture", FAMILIES)
def test_recompute_one_is_the_full_prefill(family_artifacts, architecture):
    session, headers = family_artifacts(architecture)
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    composed = compose.compose(session, headers, recompute=1.0)
    ref_ids, ref_logits = _reference(session, composed.ids, question)
    ids, logits = runtime.greedy(session, composed.cache, question, 8)
    assert ids == ref_ids
    assert _max_diff(logits, ref_logits) < TOL * max(float(x.abs().max()) for x in ref_logits)
    assert len(composed.recomputed) == len(composed.ids) - composed.prefix_tokens


@pytest.mark.parametrize("architecture", FAMILIES)
def test_recomputing_every_later_token_through_the_mask_is_the_full_prefill(family_artifacts, architecture):
    """The selective path itself (mask, true positions, write-back), with every later token chosen:
    each then sees only fresh entries after the exact prefix, as a full prefill does."""
    session, headers = family_artifacts(architecture)
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    composed = compose.compose(session, headers, recompute=0.0)
    compose.recompute_tokens(
        session, composed.cache, composed.ids, list(range(composed.prefix_tokens, len(composed.ids)))
    )
    ref_ids, ref_logits = _reference(session, composed.ids, question)
    ids, logits = runtime.greedy(session, composed.cache, question, 8, forced=ref_ids)
    assert _max_diff(logits, ref_logits) < TOL * max(float(x.abs().max()) for x in ref_logits)
    assert ids == ref_ids


#: A plain model and the MLA layouts (interleaved complex; half-split with the DSA indexer key).
COMPOSED = ["Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM"]


@pytest.mark.parametrize("architecture", COMPOSED)
def test_recompute_zero_moves_keys_and_keeps_the_first_artifact_exact(family_artifacts, architecture):
    import torch

    session, headers = family_artifacts(architecture)
    composed = compose.compose(session, headers, recompute=0.0)
    assert composed.recomputed == []
    parts = compose.load_parts(session, headers)
    first = len(parts[0][1])
    for i, layer in enumerate(session.adapter.cache_layers(composed.cache)):
        original = session.adapter.cache_layers(parts[0][0])[i]
        assert torch.equal(layer.keys[..., :first, :], original.keys)
        assert torch.equal(layer.values[..., :first, :], original.values)
    # Layer 0's keys depend on the token and its position only: the moved ones are the full prefill's
    # (MLA: the latent and the rotary key, and the DSA indexer key).
    full, _ = runtime.prefill(session, composed.ids, progress=False)
    got, want = session.adapter.cache_layers(composed.cache)[0], session.adapter.cache_layers(full)[0]
    assert _relative(got.keys, want.keys) < TOL
    if compose.is_mla(session.model):
        assert _relative(got.values, want.values) < TOL
    if getattr(want, "is_indexer_initialized", False):
        assert _relative(got.indexer_keys, want.indexer_keys) < TOL
    assert composed.offsets == [0, first, first + len(parts[1][1])]


@pytest.mark.parametrize("architecture", COMPOSED)
@pytest.mark.parametrize("rule", compose.RULES)
def test_selection_rules_pick_the_share_of_later_tokens(family_artifacts, rule, architecture):
    session, headers = family_artifacts(architecture)
    composed = compose.compose(session, headers, recompute=0.25, rule=rule)
    later = len(composed.ids) - composed.prefix_tokens
    assert abs(len(composed.recomputed) - round(0.25 * later)) <= len(headers)
    assert len(set(composed.recomputed)) == len(composed.recomputed)
    assert min(composed.recomputed) >= composed.prefix_tokens  # the true prefix is never recomputed
    if rule == "doc-start":
        for start in composed.offsets[1:]:
            assert start in composed.recomputed


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "DeepseekV2ForCausalLM"])
def test_deviation_ranks_by_the_early_layer_values(family_artifacts, architecture):
    """The chosen tokens are those whose layer-1 values moved most (checked against a direct
    computation); for MLA, the latent the values are decompressed from."""
    import torch

    session, headers = family_artifacts(architecture)
    moved = compose.compose(session, headers, recompute=0.0)
    full, _ = runtime.prefill(session, moved.ids, progress=False)
    layer = compose.DEVIATION_LAYER
    prefix = moved.prefix_tokens
    slot = "keys" if compose.is_mla(session.model) else "values"
    fresh = getattr(session.adapter.cache_layers(full)[layer], slot)[..., prefix:, :]
    stale = getattr(session.adapter.cache_layers(moved.cache)[layer], slot)[..., prefix:, :]
    deviation = (fresh - stale).pow(2).sum(dim=(0, 1, 3))
    want = sorted(int(i) + prefix for i in torch.topk(deviation, 10).indices)
    later = len(moved.ids) - prefix
    picked = compose.compose(session, headers, recompute=10 / later, rule="deviation").recomputed
    assert picked == want


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "MistralForCausalLM"])
def test_recomputation_brings_the_composition_closer_to_the_full_prefill(family_artifacts, architecture):
    """(Not on the DSA models: a random tiny indexer's top-k flips between shares, and the largest
    logit error is not monotone below R = 0.75 there; the mean is, roughly.)"""
    session, headers = family_artifacts(architecture)
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    errors = []
    for share in (0.0, 0.5, 1.0):
        composed = compose.compose(session, headers, recompute=share)
        ref_ids, ref_logits = _reference(session, composed.ids, question)
        _, logits = runtime.greedy(session, composed.cache, question, 8, forced=ref_ids)
        errors.append(_max_diff(logits, ref_logits))
    assert errors[0] > errors[1] > errors[2]


def test_artifacts_of_different_models_are_refused(family_artifacts):
    _, qwen = family_artifacts("Qwen3ForCausalLM")
    _, llama = family_artifacts("LlamaForCausalLM")
    with pytest.raises(KvcdnError, match=r"different models \(.*config.*differ\)"):
        compose.check_same_model([qwen[0], llama[1]])


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("linear_attention", "summarises the whole prefix"),
        ("recurrent_state", "summarises the whole prefix"),
    ],
)
def test_layers_that_cannot_move_are_refused_with_the_reason(family_artifacts, kind, reason):
    session, _ = family_artifacts("Qwen3ForCausalLM")
    layers = [LayerEntry(0, "full_attention"), LayerEntry(1, kind)]
    with pytest.raises(KvcdnError, match=f"layer 1 is '{kind}': .*{reason}"):
        compose.composable(session, layers)


@pytest.mark.parametrize(
    "architecture", ["GPT2LMHeadModel", "BloomForCausalLM", "GPTBigCodeForCausalLM", "GPTJForCausalLM"]
)
def test_models_without_rotary_positions_are_refused(architecture):
    model = _model(architecture, None, {})
    with pytest.raises(KvcdnError, match="no rotary position embedding"):
        compose.move_keys(model, None, 3)


def test_a_rotary_module_that_returns_angles_per_section_is_refused():
    """A rotary module that leaves the sections apart (as transformers' Qwen2-VL did before it
    recomposed them in the module) gives angles kvcdn cannot apply to one key: refused."""
    import torch

    class PerSection(torch.nn.Module):
        def __init__(self, rotary):
            super().__init__()
            self.rotary = rotary

        def forward(self, x, position_ids):
            cos, sin = self.rotary(x, position_ids)
            return cos.expand(3, *cos.shape), sin.expand(3, *sin.shape)

    model = _model("Qwen3ForCausalLM", None, {})
    model.model.rotary_emb = PerSection(model.model.rotary_emb)
    with pytest.raises(KvcdnError, match=r"returns angles per position section \(\[3, 1, 1, 16\]\)"):
        compose.move_keys(model, torch.zeros(1, 2, 4, 16), 3)


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "GptOssForCausalLM"])
@pytest.mark.parametrize("share", [0.0, 0.25])
def test_a_composed_sliding_window_layer_counts_every_token(family_artifacts, architecture, share):
    """A sliding layer's length (its positions and its mask) is a counter beside its tensors: a
    composition within the window leaves it where a full prefill does."""
    session, headers = family_artifacts(architecture)
    composed = compose.compose(session, headers, recompute=share)
    full, _ = runtime.prefill(session, composed.ids, progress=False)
    pairs = zip(session.adapter.cache_layers(composed.cache), session.adapter.cache_layers(full))
    sliding = [(got, want) for got, want in pairs if getattr(want, "is_sliding", False)]
    assert sliding
    for got, want in sliding:
        assert got.cumulative_length == want.cumulative_length == len(composed.ids)
        assert got.keys.shape == want.keys.shape and not got.record_past


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Gemma2ForCausalLM"])
def test_a_composition_longer_than_a_sliding_window_is_refused(family_artifacts, architecture):
    """The stock tiny windows (20 and 16 tokens) hold less than the documents: refused in one line."""
    adapter = adapter_classes()[architecture]
    session, headers = family_artifacts(architecture, adapter=adapter)
    window = adapter.validation_configs[architecture]["sliding_window"]
    with pytest.raises(
        KvcdnError,
        match=rf"cannot compose \d+ tokens: layer 0 has a sliding window that keeps only the last {window - 1};",
    ):
        compose.compose(session, headers)


def test_a_rotary_applied_one_tensor_at_a_time_is_refused():
    """Gemma 3n's attention rotates queries and keys in separate calls (and shares caches between
    layers): refused in one line, not a traceback."""
    import torch

    model = _model("Gemma3nForCausalLM", None, {})
    with pytest.raises(KvcdnError, match="applies rotary positions in a form kvcdn does not move"):
        compose.move_keys(model, torch.zeros(1, 2, 4, 16), 3)


def test_longrope_past_its_switch_is_refused(family_artifacts):
    """Phi-3's tiny LongRoPE switches factors past 64 tokens: moved short-factor keys would be wrong."""
    session, headers = family_artifacts("Phi3ForCausalLM", DOCUMENTS[:2])
    with pytest.raises(KvcdnError, match=r"longrope RoPE rotates positions differently past 64 tokens"):
        compose.compose(session, headers)


def test_bad_knobs_are_refused(family_artifacts):
    session, headers = family_artifacts("Qwen3ForCausalLM")
    with pytest.raises(KvcdnError, match="between 0 and 1"):
        compose.compose(session, headers, recompute=1.5)
    with pytest.raises(KvcdnError, match="unknown selection rule"):
        compose.compose(session, headers, rule="random")
