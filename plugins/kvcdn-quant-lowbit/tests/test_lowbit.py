"""int4 and int2: packing, the error bound on awkward tensors, the residual window, compression,
registration through the entry point, and a quantized artifact loading through ``kvcdn continue``."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn_core import KEY, VALUE, artifact
from kvcdn_core.quant import codec
from kvcdn_quant_lowbit import Int2Quantizer, Int4Quantizer, pack, unpack

PROFILE = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCHEMES = [Int4Quantizer, Int2Quantizer]


@PROFILE
@given(bits=st.sampled_from([2, 4]), codes=st.lists(st.integers(0, 255), max_size=200))
def test_pack_unpack_round_trip(bits, codes):
    t = torch.tensor(codes, dtype=torch.uint8) % (1 << bits)
    packed = pack(t, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-len(codes) * bits // 8)
    assert torch.equal(unpack(packed, bits, len(codes)), t)


def test_unpack_refuses_short_input():
    with pytest.raises(ValueError, match="fewer than"):
        unpack(torch.zeros(2, dtype=torch.uint8), 4, 5)


@st.composite
def tensors(draw):
    shape = [1, draw(st.integers(1, 3)), draw(st.integers(1, 90)), draw(st.integers(1, 40))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["normal", "zeros", "constant", "outliers", "offset"]))
    scale = draw(st.sampled_from([1e-6, 1.0, 50.0, 1e5]))
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "constant":
        return torch.full(shape, draw(st.floats(-1, 1, allow_nan=False)) * scale)
    x = torch.randn(shape, generator=gen) * scale
    if kind == "outliers":
        x = torch.where(torch.rand(shape, generator=gen) < 0.03, x * 500, x)
    if kind == "offset":
        x = x * 1e-2 + scale
    return x


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
@PROFILE
@given(x=tensors(), role=st.sampled_from([KEY, VALUE]), group=st.integers(1, 100), residual=st.integers(0, 100))
def test_round_trip_within_bound(cls, x, role, group, residual):
    q = cls(group_size=group, residual=residual)
    parts, record = q.quantize(role, x)
    y = q.dequantize(parts, record)
    assert y.shape == x.shape and torch.isfinite(y).all()
    err = (x - y).abs()
    assert (err - q.error_bound(role, x)).max() <= 0, record
    keep = min(residual, x.shape[-2])
    assert record["residual_tokens"] == keep
    if keep:
        assert torch.equal(y[..., -keep:, :], x[..., -keep:, :])
    if keep < x.shape[-2]:
        assert parts[""].dtype == torch.uint8
        assert parts[""].numel() == -(-(x.numel() // x.shape[-2] * (x.shape[-2] - keep)) * q.bits // 8)


@pytest.mark.parametrize("cls,minimum", [(Int4Quantizer, 3.4), (Int2Quantizer, 5.0)], ids=["int4", "int2"])
def test_compression_of_a_float16_cache(cls, minimum):
    """Bytes stored for a 2k-token float16 K/V pair (head_dim 128) with the default group sizes."""
    x = (torch.randn(1, 8, 2048, 128) * 2).to(torch.float16)
    q = cls(residual=0)
    stored = sum(p.numel() * p.element_size() for role in (KEY, VALUE) for p in q.quantize(role, x)[0].values())
    assert 2 * x.numel() * 2 / stored >= minimum


def test_defaults_and_registration(discovered_host):
    assert Int4Quantizer().params == {"group_size": 64, "residual": 128}
    assert Int2Quantizer().params == {"group_size": 32, "residual": 128}
    schemes = discovered_host.quantizers()
    assert schemes["int4"] is Int4Quantizer and schemes["int2"] is Int2Quantizer
    info = discovered_host.infos["lowbit"]
    assert info.distribution == "kvcdn-quant-lowbit" and "kvcdn.quantizers" in info.groups


def test_sensitive_layer_kinds_stay_full_precision():
    assert not Int4Quantizer().supports(artifact.MLA_LATENT)
    assert not Int2Quantizer().supports(artifact.RECURRENT_STATE)
    assert not Int2Quantizer().supports(artifact.LINEAR_ATTENTION)
    assert Int4Quantizer().supports(artifact.SLIDING_WINDOW)


def test_int4_artifact_loads_through_continue(tiny_model, tmp_path):
    from click.testing import CliRunner
    from kvcdn_model_qwen import QwenAdapter

    from kvcdn_core import runtime
    from kvcdn_core.cli.app import make_cli
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    model_dir = tiny_model(QwenAdapter, "Qwen3ForCausalLM")
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    src = tmp_path / "doc.kv"
    runtime.generate(session, SAMPLE_TEXT, src, progress=False)
    runner = CliRunner()
    result = runner.invoke(
        make_cli(), ["quant", "--kv-path", str(src), "--scheme", "int4", "--residual", "16", "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    event = json.loads(result.stdout)
    out = tmp_path / "doc.int4.kv"
    assert event["output"] == str(out) and event["parameters"] == {"group_size": 64, "residual": 16}
    assert event["storage_dtype"] == "U8" and event["compression_ratio"] > 3
    manifest = artifact.read_manifest(out)
    rec = manifest["quantization"]["layers"][0]["tensors"]["value"]
    assert rec["parts"] == ["", "residual", "scale", "zero"] and rec["residual_tokens"] == 16
    result = runner.invoke(make_cli(), ["continue", "--kv-path", str(out), "--n", "4", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reused_tokens"] == manifest["token_count"]


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.scheme)
def test_a_streamed_load_equals_the_whole_load(cls, tiny_session, tmp_path, monkeypatch):
    """Streamed layer by layer (each layer unpacked as it arrives) or loaded whole: the same cache,
    tensor for tensor, and the same continuation, token for token (float32, tiny Qwen3)."""
    from kvcdn_model_qwen import QwenAdapter

    from kvcdn_core import cores, runtime
    from kvcdn_core.artifact.layer_stream import GatedLayers
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    session = tiny_session(QwenAdapter, "Qwen3ForCausalLM")
    src, ids = runtime.generate(session, SAMPLE_TEXT, tmp_path / "doc.kv", progress=False)
    header = artifact.read_header(src)
    result = codec.quantize_cache(header.manifest, artifact.load_tensors(header), cls(group_size=16, residual=8))
    out = artifact.write_artifact(tmp_path / f"doc.{cls.scheme}.kv", result.manifest, result.tensors)
    whole, _ = runtime.load_cache(session, artifact.read_header(out))
    monkeypatch.setattr(cores, "stream_workers", lambda _torch_threads: 1)  # streamed, whatever the cores
    streamed, streamed_ids = runtime.load_cache(session, artifact.read_header(out), stream=True)
    assert isinstance(streamed.layers, GatedLayers) and streamed_ids == ids
    for a, b in zip(whole.layers, streamed.layers):
        assert a.keys.dtype == b.keys.dtype == torch.float32
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    question = session.adapter.encode_continuation(session.tokenizer, " And then?")
    assert runtime.greedy(session, streamed, question, 6)[0] == runtime.greedy(session, whole, question, 6)[0]


def test_context_shorter_than_the_residual_window_round_trips_bitwise(tmp_path):
    """Every token in the residual window: empty codes in the file, the tensors come back bitwise."""
    tensors = {
        "layers.0.key": torch.randn(1, 2, 40, 16),
        "layers.0.value": torch.randn(1, 2, 40, 16),
        artifact.TOKEN_IDS: torch.arange(40),
    }
    manifest = {
        "kvcdn_version": "0",
        "created_at": "now",
        "model": {"id": "fake"},
        "compute_dtype": "float32",
        "quantization": None,
        "layers": [
            {"index": 0, "kind": artifact.FULL_ATTENTION, "tensors": {"key": "layers.0.key", "value": "layers.0.value"}}
        ],
    }
    result = codec.quantize_cache(manifest, tensors, Int4Quantizer())
    out = artifact.write_artifact(tmp_path / "short.int4.kv", result.manifest, result.tensors)
    header = artifact.read_header(out)
    assert header.entries["layers.0.key"]["shape"] == [0]
    deq = codec.dequantize_tensors(header)
    for name, t in tensors.items():
        assert torch.equal(deq[name], t), name


@pytest.mark.parametrize("cls", [Int4Quantizer, Int2Quantizer], ids=lambda c: c.scheme)
def test_lowbit_schemes_pass_the_quantizer_contract(cls):
    from kvcdn_core.testing import assert_quantizer_contract

    assert_quantizer_contract(cls)
