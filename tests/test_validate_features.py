"""``kvcdn validate --format json`` says, per architecture shape, what the run exercised."""

from __future__ import annotations

import json

from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import LayerEntry
from kvcdn_core.exactness.architecture import exercised


def config(architecture: str, **kwargs):
    import transformers

    return getattr(transformers, architecture).config_class(**kwargs)


def test_exercised_names_layer_kinds_features_and_shape():
    cfg = config(
        "Qwen3MoeForCausalLM",
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64},
    )
    layers = [
        LayerEntry(0, artifact.SLIDING_WINDOW, window=16, cumulative_length=20),
        LayerEntry(1, artifact.FULL_ATTENTION),
    ]
    proven = exercised(cfg, layers)
    assert proven["layer_kinds"] == [artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW]
    assert proven["features"] == [artifact.SLIDING_WINDOW, "moe", "rope:yarn", "tied_embeddings"]
    assert proven["shape"] == {"heads": 8, "kv_heads": 2, "head_dim": 32}


def test_plain_config_proves_no_feature():
    cfg = config(
        "LlamaForCausalLM", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False
    )
    proven = exercised(cfg, [LayerEntry(i, artifact.FULL_ATTENTION) for i in range(2)])
    assert proven["features"] == [] and proven["shape"] == {"heads": 4, "kv_heads": 4, "head_dim": 16}


def test_recurrent_and_linear_kinds_are_features():
    cfg = config("Qwen3NextForCausalLM")
    proven = exercised(cfg, [LayerEntry(0, artifact.LINEAR_ATTENTION), LayerEntry(1, artifact.RECURRENT_STATE)])
    assert {artifact.LINEAR_ATTENTION, artifact.RECURRENT_STATE} <= set(proven["features"])


def test_sparse_attention_and_kv_sharing_are_features():
    cfg = config("LlamaForCausalLM", tie_word_embeddings=False)
    indexed = exercised(cfg, [LayerEntry(0, artifact.MLA_INDEXED), LayerEntry(1, artifact.MLA_LATENT)])
    assert indexed["layer_kinds"] == [artifact.MLA_INDEXED, artifact.MLA_LATENT]
    assert indexed["features"] == ["mla", "sparse_attention"]
    shared = exercised(
        cfg,
        [
            LayerEntry(0, artifact.FULL_ATTENTION, family_fields={"shared_by": [2, 3]}),
            LayerEntry(1, artifact.FULL_ATTENTION),
        ],
    )
    assert shared["features"] == ["kv_sharing"]


def test_validate_json_reports_each_shape(run_kvcdn):
    code, out, err = run_kvcdn("validate", "--family", "deepseek", "--format", "json", "-q")
    assert code == 0, err
    rows = json.loads(out)["architectures"]
    assert {(r["architecture"], r["variant"]) for r in rows} >= {
        ("DeepseekV3ForCausalLM", "default"),
        ("DeepseekV3ForCausalLM", "8q-kv2"),
    }
    for row in rows:
        sparse = row["architecture"] == "DeepseekV32ForCausalLM"
        assert row["passed"] and row["layer_kinds"] == [artifact.MLA_INDEXED if sparse else artifact.MLA_LATENT]
        assert {"mla", "moe"} <= set(row["features"])
        assert ("sparse_attention" in row["features"]) == sparse
    assert any(r["shape"]["kv_heads"] != r["shape"]["heads"] for r in rows)
    assert any("rope:yarn" in r["features"] for r in rows)
