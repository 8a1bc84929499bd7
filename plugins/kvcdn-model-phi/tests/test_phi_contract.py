import pytest
from kvcdn_model_phi import PhiAdapter

from kvcdn_core import artifact, runtime
from kvcdn_core.errors import KvcdnError
from kvcdn_core.exactness.against_prefill import run_verify
from kvcdn_core.exactness.architecture import validate_tiny
from kvcdn_core.model import rope_regime
from kvcdn_core.testing import assert_adapter_contract

pytestmark = pytest.mark.slow  # real model runs on every tiny config of the family


@pytest.mark.parametrize("architecture", sorted(PhiAdapter.validation_configs))
def test_adapter_contract(architecture, tmp_path):
    assert_adapter_contract(PhiAdapter, architecture, tmp_path)
    kinds = {layer["kind"] for layer in artifact.read_manifest(tmp_path / f"{architecture}.kv")["layers"]}
    assert kinds == {artifact.FULL_ATTENTION}


def test_longrope_context_crosses_the_switch(tmp_path, monkeypatch):
    """The LongRoPE config really crosses short→long in the chunked prefill: without core's
    recompute the cached continuation diverges from the full prefill at once."""
    monkeypatch.setattr(rope_regime, "guarded_forward", lambda adapter, model, ids, cache, run: run(model, ids, cache))
    results = validate_tiny(PhiAdapter, "Phi3ForCausalLM", tmp_path)
    cache = next(r for r in results if r.phase == "cache")
    assert not cache.passed and cache.first_divergence is not None


def test_short_longrope_artifact_is_not_continued_past_the_switch(tiny_model, tmp_path):
    """An artifact shorter than original_max_position_embeddings was rotated with the short
    factors: continuing it past the switch is refused, never silently different."""
    session = runtime.load_session(
        str(tiny_model(PhiAdapter, "Phi3ForCausalLM")), device="cpu", dtype="float32", adapter_cls=PhiAdapter
    )
    path, ids = runtime.generate(session, "The lighthouse keeper kept a ledger.", tmp_path / "short.kv", progress=False)
    assert len(ids) < 64
    header = artifact.read_header(path)
    assert run_verify(session, header, " Reuse", 4).passed  # stays below the switch: exact
    with pytest.raises(KvcdnError, match="LongRoPE .* 64 tokens"):
        run_verify(session, header, " Reuse", 64)


def test_sliding_window_phi3_is_exact(tmp_path):
    """Phi-3-mini-4k style: default RoPE and a sliding window, crossed by the context."""
    plain = {
        k: v
        for k, v in PhiAdapter.validation_configs["Phi3ForCausalLM"].items()
        if k not in ("rope_parameters", "original_max_position_embeddings")
    }

    class SlidingPhi3(PhiAdapter):
        validation_configs = {"Phi3ForCausalLM": dict(plain, sliding_window=24)}

    assert_adapter_contract(SlidingPhi3, "Phi3ForCausalLM", tmp_path)
    kinds = {layer["kind"] for layer in artifact.read_manifest(tmp_path / "Phi3ForCausalLM.kv")["layers"]}
    assert kinds == {artifact.SLIDING_WINDOW}
