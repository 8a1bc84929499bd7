"""``kvcdn quant`` end to end on the tiny Qwen models: outputs, refusals, --verify, the event file,
and loading quantized artifacts through ``verify`` and ``continue`` (which dequantize transparently).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from kvcdn_model_qwen import QwenAdapter
from safetensors.torch import load_file

from kvcdn_core import artifact, runtime
from kvcdn_core.errors import ArtifactError, KvcdnError
from kvcdn_core.model.tiny import SAMPLE_TEXT, teach_tiny_model
from kvcdn_core.plugin_host.registry import quantizer_for
from kvcdn_core.quant import codec

pytestmark = pytest.mark.slow  # trains a tiny model per test (teach_tiny_model)


PARAGRAPHS = SAMPLE_TEXT.split("\n\n")
MEMO_CONTEXT = "\n\n".join(PARAGRAPHS[:3]) + "\n\n"
MEMO_QUESTION = "Engineers who run retrieval services"


def memorize(model_dir, out_dir, steps=60):
    """A tiny model trained to recite the sample text, so its logits are decisive."""
    teach_tiny_model(model_dir, out_dir, steps=steps)
    return out_dir


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def sample(tmp_path_factory, tiny_model):
    """A float32 artifact of the tiny Qwen3 model (taught the sample text) over its first paragraphs."""
    base = tmp_path_factory.mktemp("quant")
    model_dir = memorize(tiny_model(QwenAdapter, "Qwen3ForCausalLM"), base / "model")
    session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
    path = base / "doc.kv"
    runtime.generate(session, MEMO_CONTEXT, path, chunk=100, progress=False)
    return path


@pytest.fixture
def doc(sample, tmp_path):
    """A private copy of the sample artifact (tests write outputs next to their input)."""
    path = tmp_path / "doc.kv"
    path.write_bytes(sample.read_bytes())
    return path


def _families():
    """Qwen configs, plus DeepSeek's MLA latent when that plugin is installed."""
    cases = [(QwenAdapter, arch) for arch in sorted(QwenAdapter.validation_configs)]
    try:
        from kvcdn_model_deepseek import DeepseekAdapter
    except ImportError:
        return cases
    return cases + [(DeepseekAdapter, "DeepseekV3ForCausalLM")]


@pytest.mark.parametrize("adapter_cls,architecture", _families(), ids=lambda v: getattr(v, "__name__", v))
def test_int8_verify_is_token_exact(adapter_cls, architecture, tiny_model, tmp_path, cli):
    model_dir = memorize(tiny_model(adapter_cls, architecture), tmp_path / "model")
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(MEMO_CONTEXT, encoding="utf-8")
    result = cli(
        "quant",
        "--context-file",
        ctx,
        "--model",
        model_dir,
        "--verify",
        "--n",
        16,
        "-q",
        "--question",
        MEMO_QUESTION,
        "--format",
        "json",
    )
    assert result.exit_code == 0, result.output + result.stderr
    event = json.loads(result.stdout)
    assert event["verification"] == "Match" and event["mismatch_indices"] == []
    assert event["verify"]["reference_matches"] == 16 and event["verify"]["unquantized_matches"] == 16
    assert "the same manu" in event["verify"]["reference_text"], "the model recites the sample text"
    assert event["input_kind"] == "context" and event["output"] == str(tmp_path / "ctx.q8.kv")
    assert event["quantized_layers"] >= 1
    assert event["quantized_layers"] + event["full_precision_layers"] == event["layers"]
    if adapter_cls.family == "deepseek":
        assert event["quantized_layers"] == event["layers"], "int8 quantizes MLA latents too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx.q8.kv", "ctx.q8.kv.quant-event.json", "ctx.txt", "model"]


def test_quant_input_defaults_stats_and_event(doc, cli):
    before = sha(doc)
    result = cli("quant", "--kv-path", doc)
    assert result.exit_code == 0, result.output + result.stderr
    out = doc.with_name("doc.q8.kv")
    assert out.is_file() and sha(doc) == before, "the input is never modified"
    assert "compression" in result.output and "key   error: max" in result.output
    event = json.loads((doc.parent / "doc.q8.kv.quant-event.json").read_text())
    for key in (
        "input",
        "output",
        "model",
        "scheme",
        "target_dtype",
        "storage_dtype",
        "tokens",
        "layers",
        "original_bytes",
        "quantized_bytes",
        "compression_ratio",
        "max_error",
        "verification",
        "mismatch_indices",
        "timestamp",
    ):
        assert key in event, key
    assert event["verification"] == "Skipped" and event["scheme"] == "int8"
    assert event["original_bytes"] == doc.stat().st_size and event["quantized_bytes"] == out.stat().st_size
    assert event["compression_ratio"] > 3.0  # float32 → int8 codes + float16 scales
    assert event["target_dtype"] == "F32" and event["storage_dtype"] == "I8"
    assert 0 < event["errors"]["key"]["max_relative"] <= 1 / 254 * 1.01
    m = artifact.read_manifest(out)
    assert artifact.read_token_ids(out) == artifact.read_token_ids(doc)
    q = m["quantization"]
    assert q["scheme"] == "int8" and q["parameters"] == {} and q["version"] == 1
    assert [rec["action"] for rec in q["layers"]] == ["quantized", "quantized"]
    key = q["layers"][0]["tensors"]["key"]
    assert key["name"] == "layers.0.key" and key["parts"] == ["", "scale"] and key["granularity"] == "per_channel"
    assert m["tensors"]["layers.0.key"]["dtype"] == "I8"
    assert not [p for p in doc.parent.iterdir() if p.name.startswith(".")], "no temporary files left"


@pytest.mark.parametrize("scheme,name", [("fp8", "doc.fp8.kv"), ("int8-tensor", "doc.int8-tensor.kv")])
def test_default_output_names(doc, cli, scheme, name):
    result = cli("quant", "--kv-path", doc, "--scheme", scheme)
    assert result.exit_code == 0, result.stderr
    assert (doc.parent / name).is_file()


def test_dequantized_tensors_have_the_unquantized_names_and_shapes(doc, cli):
    assert cli("quant", "--kv-path", doc, "--target-dtype", "F16", "-o", doc.parent / "h.kv").exit_code == 0
    plain = artifact.load_tensors(artifact.read_header(doc))
    header = artifact.read_header(doc.parent / "h.kv")
    assert header.manifest["quantization"]["target_dtype"] == "F16"
    deq = codec.dequantize_tensors(header)
    assert set(deq) == set(plain)
    for name, t in plain.items():
        assert deq[name].shape == t.shape
        if name != artifact.TOKEN_IDS:
            assert deq[name].dtype == torch.float16
            assert float((deq[name].float() - t).abs().max()) <= float(t.abs().max()) / 127
    assert torch.equal(deq[artifact.TOKEN_IDS], plain[artifact.TOKEN_IDS])


def test_quantized_artifact_loads_in_verify_and_continue(doc, cli):
    q = ("--question", MEMO_QUESTION)
    assert cli("quant", "--kv-path", doc, "--verify", "--n", 8, *q).exit_code == 0
    out = doc.with_name("doc.q8.kv")
    result = cli("verify", "--kv-path", out, "--n", 8, "--format", "json", *q)
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads(result.stdout)["status"] == "PASS"
    plain = json.loads(cli("continue", "--kv-path", doc, "--n", 8, "--format", "json", *q).stdout)
    quantized = json.loads(cli("continue", "--kv-path", out, "--n", 8, "--format", "json", *q).stdout)
    assert quantized["token_ids"] == plain["token_ids"] and "know the" in quantized["text"]


def test_mismatch_exits_1_and_still_writes_the_event(doc, cli):
    out = doc.parent / "crushed.kv"
    result = cli(
        "quant",
        "--kv-path",
        doc,
        "--scheme",
        "int2",
        "--residual",
        "0",
        "--group-size",
        "64",
        "-o",
        out,
        "--verify",
        "--n",
        16,
        "--question",
        MEMO_QUESTION,
    )
    assert result.exit_code == 1, result.output + result.stderr
    assert "diverges from the full prefill" in result.stderr and "Traceback" not in result.stderr
    event = json.loads((doc.parent / "crushed.kv.quant-event.json").read_text())
    assert event["verification"] == "Mismatch" and event["mismatch_indices"]
    assert event["verify"]["first_divergence_reference"] == event["mismatch_indices"][0]
    assert out.is_file()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--target-dtype", "U8"], "U8 is not supported: unsigned"),
        (["--target-dtype", "I4"], "use --scheme int4"),
        (["--target-dtype", "FP4"], "no kvcdn scheme stores 4-bit floats"),
        (["--target-dtype", "FP1"], "no 1-bit float"),
        (["--target-dtype", "FP8", "--scheme", "int8"], "contradicts --scheme int8"),
        (["--scheme", "int3"], "no installed quantizer provides scheme 'int3'"),
        (["--group-size", "32"], "takes no parameter group_size"),
        (["--scheme", "int4", "--group-size", "0"], "group_size must be a positive integer"),
    ],
)
def test_refusals_say_why(doc, cli, args, message):
    result = cli("quant", "--kv-path", doc, *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.startswith("error: ")
    assert not doc.with_name("doc.q8.kv").exists()


def test_verify_with_another_model_is_refused_before_writing(doc, cli, tiny_model):
    other = tiny_model(QwenAdapter, "Qwen2ForCausalLM")
    result = cli("quant", "--kv-path", doc, "--verify", "--model", other)
    assert result.exit_code == 2 and "artifact was made with model" in result.stderr
    assert not doc.with_name("doc.q8.kv").exists()
    assert not doc.with_name("doc.q8.kv.quant-event.json").exists()


def test_input_is_never_overwritten(doc, cli):
    before = sha(doc)
    result = cli("quant", "--kv-path", doc, "--output", doc)
    assert result.exit_code == 2 and "never overwrites its input" in result.stderr
    assert sha(doc) == before


def test_input_and_context_are_exclusive(doc, cli, tmp_path):
    assert "exactly one of --kv-path" in cli("quant").stderr
    ctx = tmp_path / "c.txt"
    ctx.write_text("x", encoding="utf-8")
    assert cli("quant", "--kv-path", doc, "--context-file", ctx).exit_code == 2
    assert "does not exist" in cli("quant", "--kv-path", tmp_path / "none.kv").stderr


def test_quantized_input_is_refused(doc, cli):
    assert cli("quant", "--kv-path", doc).exit_code == 0
    result = cli("quant", "--kv-path", doc.with_name("doc.q8.kv"), "--scheme", "fp8")
    assert result.exit_code == 2 and "already quantized (scheme int8)" in result.stderr


def test_storage_dtype_picks_the_scheme(doc, cli):
    result = cli("quant", "--kv-path", doc, "--target-dtype", "FP8", "--format", "json")
    assert result.exit_code == 0
    event = json.loads(result.stdout)
    assert event["scheme"] == "fp8" and event["storage_dtype"] == "F8_E4M3" and event["target_dtype"] == "F32"


def test_dtype_is_the_compute_dtype_as_in_every_model_command(doc, cli):
    """--dtype means the compute dtype everywhere; the target is --target-dtype."""
    wrong = cli("quant", "--kv-path", doc, "--dtype", "F16")
    assert wrong.exit_code == 2 and "--dtype" in wrong.stderr and "'F16'" in wrong.stderr
    result = cli("quant", "--kv-path", doc, "--dtype", "float32", "--verify", "--n", "4", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["verification"] == "Match"


def test_the_retired_compute_dtype_spelling_points_to_dtype(doc, cli):
    """--compute-dtype was deprecated for a release; one way remains, and the refusal names it."""
    result = cli("quant", "--kv-path", doc, "--compute-dtype", "float32")
    assert result.exit_code == 2 and "--compute-dtype" in result.stderr and "--dtype" in result.stderr


def _fake_artifact(path, kinds):
    """An artifact whose layers have the given kinds, without a model (quantization needs none)."""
    layers, tensors = [], {}
    gen = torch.Generator().manual_seed(0)
    for i, kind in enumerate(kinds):
        names = (
            {"latent": (1, 1, 40, 32), "rotary_key": (1, 1, 40, 8)}
            if kind == artifact.MLA_LATENT
            else {"state": (1, 8, 16)}
            if kind == artifact.RECURRENT_STATE
            else {"key": (1, 2, 40, 16), "value": (1, 2, 40, 16)}
        )
        layers.append({"index": i, "kind": kind, "tensors": {k: f"layers.{i}.{k}" for k in names}})
        for k, shape in names.items():
            tensors[f"layers.{i}.{k}"] = torch.randn(shape, generator=gen)
    tensors[artifact.TOKEN_IDS] = torch.arange(40)
    manifest = {
        "kvcdn_version": "0",
        "created_at": "now",
        "model": {"id": "fake"},
        "compute_dtype": "float32",
        "layers": layers,
        "quantization": None,
    }
    return artifact.write_artifact(path, manifest, tensors)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_cache_holding_nan_or_inf_is_refused_in_one_line_and_nothing_written(tmp_path, cli, bad):
    path = tmp_path / "bad.kv"
    _fake_artifact(path, [artifact.FULL_ATTENTION, artifact.FULL_ATTENTION])
    header = artifact.read_manifest(path)
    tensors = load_file(path)
    tensors["layers.1.value"][0, 1, 7, 3] = bad
    artifact.write_artifact(path, header, tensors)
    result = cli("quant", "--kv-path", path)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "holds inf or NaN" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["bad.kv"]


def test_unsupported_layer_kinds_are_kept_and_recorded(tmp_path):
    path = _fake_artifact(tmp_path / "mix.kv", [artifact.FULL_ATTENTION, artifact.MLA_LATENT, artifact.RECURRENT_STATE])
    header = artifact.read_header(path)
    plain = artifact.load_tensors(header)
    result = codec.quantize_cache(header.manifest, plain, quantizer_for("fp8")())
    actions = [(r["kind"], r["action"]) for r in result.manifest["quantization"]["layers"]]
    assert actions == [
        ("full_attention", "quantized"),
        ("mla_latent", "full_precision"),
        ("recurrent_state", "full_precision"),
    ]
    assert "does not support mla_latent" in result.manifest["quantization"]["layers"][1]["reason"]
    out = artifact.write_artifact(tmp_path / "mix.fp8.kv", result.manifest, result.tensors)
    deq = codec.dequantize_tensors(artifact.read_header(out))
    assert set(deq) == set(plain)
    for name in ("layers.1.latent", "layers.1.rotary_key", "layers.2.state"):
        assert torch.equal(deq[name], plain[name]), name
    # int8 handles the MLA latent (per channel); recurrent state stays full precision
    result = codec.quantize_cache(header.manifest, plain, quantizer_for("int8")())
    assert [r["action"] for r in result.manifest["quantization"]["layers"]] == [
        "quantized",
        "quantized",
        "full_precision",
    ]


def test_corrupted_quantized_artifacts_are_refused(doc, cli, tmp_path):
    assert cli("quant", "--kv-path", doc).exit_code == 0
    out = doc.with_name("doc.q8.kv")
    header = artifact.read_header(out)
    raw = bytearray(out.read_bytes())
    raw[header.data_start + header.entries["layers.0.key.scale"]["data_offsets"][0]] ^= 0xFF
    bad = tmp_path / "bad.kv"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="blake3 mismatch"):
        codec.dequantize_tensors(artifact.read_header(bad))
    manifest = dict(header.manifest)
    manifest["quantization"] = {**manifest["quantization"], "scheme": "int9"}
    tensors = artifact.load_tensors(header)
    artifact.write_artifact(tmp_path / "unknown.kv", manifest, tensors)
    with pytest.raises(KvcdnError, match="no installed quantizer provides scheme 'int9'"):
        codec.dequantize_tensors(artifact.read_header(tmp_path / "unknown.kv"))
    manifest["quantization"] = {**header.manifest["quantization"], "version": 99}
    artifact.write_artifact(tmp_path / "newer.kv", manifest, tensors)
    with pytest.raises(ArtifactError, match="newer than this kvcdn reads"):
        codec.dequantize_tensors(artifact.read_header(tmp_path / "newer.kv"))


def test_quant_help_lists_the_installed_schemes_with_a_plugin_one(kvcdn_host):
    """`--scheme`'s help is asked of the registry when shown: a plugin's scheme appears with its description."""
    import types

    from click.testing import CliRunner

    import kvcdn_core
    from kvcdn_core.cli.app import make_cli
    from kvcdn_core.plugin_host.registry import quantizer_for

    class Six(quantizer_for("int8")):
        scheme = "int6-help"
        description = "six bits, for the help test"

    plugin = types.SimpleNamespace(kvcdn_register_quantizers=kvcdn_core.hookimpl(lambda: [Six]))
    kvcdn_host.register(plugin, "six", "kvcdn.quantizers")
    out = CliRunner().invoke(make_cli(), ["quant", "--help"], terminal_width=400).stdout
    assert "int6-help (six bits, for the help test)" in out
    assert "int8 (symmetric int8, per-channel scales for keys, per-token scales for values)" in out


def test_quant_reads_kv_path_and_the_old_input_spelling_warns(doc, cli, tmp_path):
    """The artifact a model command reads is --kv-path everywhere; quant's --input works one release more."""
    old = cli("quant", "--input", doc, "--output", tmp_path / "old.kv")
    assert old.exit_code == 0, old.stderr
    assert "warning: quant --input is deprecated; use --kv-path" in old.stderr
    assert (tmp_path / "old.kv").is_file()
