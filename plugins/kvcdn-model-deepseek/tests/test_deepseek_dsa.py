"""DeepSeek-V3.2 sparse attention: the artifact holds the indexer keys, and they decide the output.

The tiny configs select 8-24 keys per query out of a 96+ token context, so a continuation from the
artifact is exact only if the restored indexer picks the same keys as a full prefill's.
"""

import pytest
from kvcdn_model_deepseek import INDEXER_KEY, LATENT, ROTARY_KEY, DeepseekAdapter

from kvcdn_core import LayerEntry, artifact, runtime
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.exactness.architecture import long_context
from kvcdn_core.model.tiny import config_variants
from kvcdn_core.testing import assert_prefix_reuse

pytestmark = pytest.mark.slow  # real model runs

ARCH = "DeepseekV32ForCausalLM"
QUESTION = " What did the keeper write?"


@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session(DeepseekAdapter, ARCH)


@pytest.fixture(scope="module")
def header(session, tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "doc.kv"
    return artifact.read_header(runtime.generate(session, long_context(96, session.tokenizer), path, progress=False)[0])


def test_every_shape_selects_fewer_keys_than_the_validation_context():
    """kvcdn validate's context is at least 96 tokens: every shape's top-k must leave keys out."""
    for config in config_variants(DeepseekAdapter, ARCH).values():
        assert config["index_topk"] * 4 <= 96 and config["index_n_heads"] >= 16


def test_artifact_holds_latent_rotary_key_and_indexer_keys(session, header):
    config, manifest = session.model.config, header.manifest
    tokens = header.token_count
    assert config.index_topk < tokens // 4  # the indexer really selects: 16 of 100+ keys
    assert manifest["reuse"] == "any_prefix"
    for layer in manifest["layers"]:
        assert layer["kind"] == artifact.MLA_INDEXED
        assert layer["index_head_dim"] == config.index_head_dim
        shapes = {role: manifest["tensors"][name]["shape"] for role, name in layer["tensors"].items()}
        assert shapes == {
            LATENT: [1, 1, tokens, config.kv_lora_rank],
            ROTARY_KEY: [1, 1, tokens, config.qk_rope_head_dim],
            INDEXER_KEY: [1, tokens, config.index_head_dim],
        }


def test_rebuilt_cache_is_the_prefill_cache(session, header):
    import torch

    ids = artifact.read_token_ids(header.path, header)
    fresh, _ = runtime.prefill(session, ids, progress=False)
    rebuilt, _ = runtime.load_cache(session, header)
    for a, b in zip(fresh.layers, rebuilt.layers):
        assert type(a) is type(b)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.indexer_keys, b.indexer_keys)


def test_the_indexer_keys_decide_the_continuation(session, header):
    """Restored without its own indexer keys (rolled by one token), the cache continues differently:
    the exactness the contract checks depends on the indexer cache, not only on the latent."""
    import torch

    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    cache, _ = runtime.load_cache(session, header)
    exact, exact_logits = runtime.greedy(session, cache, question, 8)
    cache, _ = runtime.load_cache(session, header)
    for layer in cache.layers:
        layer.indexer_keys = torch.roll(layer.indexer_keys, 1, dims=1)
    _, wrong_logits = runtime.greedy(session, cache, question, 8, forced=exact)
    assert max(float((a - b).abs().max()) for a, b in zip(exact_logits, wrong_logits)) > 1e-3


def test_prefix_search_crops_latent_and_indexer_exactly(session, tmp_path):
    assert assert_prefix_reuse(session, tmp_path) > session.model.config.index_topk


def test_an_artifact_without_indexer_keys_is_refused(session, header):
    layers = [
        LayerEntry.from_dict(
            dict(
                layer, kind=artifact.MLA_LATENT, tensors={k: v for k, v in layer["tensors"].items() if k != INDEXER_KEY}
            )
        )
        for layer in header.manifest["layers"]
    ]
    with pytest.raises(ArtifactError, match="'mla_latent' in the artifact, the model caches 'mla_indexed'"):
        session.adapter.import_cache(session.model, layers, artifact.load_tensors(header), "cpu")


def test_another_indexer_width_is_refused(session, header):
    layers = [LayerEntry.from_dict(dict(layer, index_head_dim=64)) for layer in header.manifest["layers"]]
    with pytest.raises(ArtifactError, match="indexer keys of width 64"):
        session.adapter.import_cache(session.model, layers, artifact.load_tensors(header), "cpu")


def test_a_cache_without_its_indexer_keys_is_not_written(session, header):
    cache, _ = runtime.load_cache(session, header)
    layer = cache.layers[0]
    layer.indexer_keys, layer.is_indexer_initialized = None, False
    with pytest.raises(KvcdnError, match="lacks DSA indexer keys"):
        session.adapter.export_cache(session.model, cache)


def test_indexer_keys_of_another_length_are_not_written(session, header):
    cache, _ = runtime.load_cache(session, header)
    cache.layers[1].indexer_keys = cache.layers[1].indexer_keys[:, :-1, :]
    with pytest.raises(KvcdnError, match="not one 16-wide key per token"):
        session.adapter.export_cache(session.model, cache)
