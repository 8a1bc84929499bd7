"""The fast load paths are exact: direct and buffered reads, whole and layer-streamed loads all
continue like a full prefill of the same tokens (token ids, float32, tiny models, one of them with
sliding-window layers); a quantized artifact streamed layer by layer gives the tensors and tokens of
its whole load; and a corrupted layer fails loudly, when it is reached, instead of being used.
Streamed loads run with one worker and with two (the cores torch leaves free); where torch has every
core nothing is streamed."""

from __future__ import annotations

import copy
import threading

import pytest

from kvcdn_core import artifact, runtime
from kvcdn_core.artifact import tensor_io
from kvcdn_core.artifact.layer_stream import GatedLayers
from kvcdn_core.artifact.manifest import LayerEntry, Manifest
from kvcdn_core.errors import ArtifactError
from kvcdn_core.model.tiny import SAMPLE_TEXT
from kvcdn_core.quant import codec
from tests.support.budget import budget

QUESTION = " And what comes next?"
N_NEW = 8
FAMILIES = [
    ("kvcdn_model_qwen", "QwenAdapter", "Qwen3ForCausalLM"),
    ("kvcdn_model_gemma", "GemmaAdapter", "Gemma3ForCausalLM"),
]  # layers 0 and 2 slide


@pytest.fixture(scope="module", params=FAMILIES, ids=[arch for *_, arch in FAMILIES])
def case(request, tiny_session, tmp_path_factory):
    """A tiny model, an artifact of the sample text, and the greedy continuation of a full prefill."""
    import importlib

    module, name, arch = request.param
    session = tiny_session(getattr(importlib.import_module(module), name), arch)
    path = tmp_path_factory.mktemp(arch) / "ctx.kv"
    path, ids = runtime.generate(session, SAMPLE_TEXT, path, progress=False)
    question = session.adapter.encode_continuation(session.tokenizer, QUESTION)
    full, _ = runtime.prefill(session, ids + question, progress=False)  # one prefill of everything
    expected, _ = runtime.greedy(session, runtime.prefill(session, ids, progress=False)[0], question, N_NEW)
    # The reference itself: greedy on the full prefill of context + question gives the same first token.
    first_full, _ = runtime.decode_from(session, full, runtime.prefill(session, ids + question, progress=False)[1], 1)
    assert first_full == expected[:1]
    return session, path, ids, question, expected


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def verifiers(request, monkeypatch):
    """The streamed load's workers, as if torch left that many cores free (whatever this machine has)."""
    from kvcdn_core import cores

    monkeypatch.setattr(cores, "stream_workers", lambda _torch_threads: request.param)
    return request.param


def _kinds(path):
    return {layer["kind"] for layer in artifact.read_header(path).manifest["layers"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("direct", [None, True, False], ids=["auto", "direct", "buffered"])
def test_loaded_cache_continues_exactly_like_a_full_prefill(case, stream, direct, verifiers, monkeypatch):
    session, path, ids, question, expected = case
    if direct is not None:
        original = tensor_io.TensorReader.__init__
        monkeypatch.setattr(
            tensor_io.TensorReader, "__init__", lambda self, header, _direct=None: original(self, header, direct)
        )
    cache, loaded_ids = runtime.load_cache(session, artifact.read_header(path), stream=stream)
    assert isinstance(cache.layers, GatedLayers) is stream
    assert loaded_ids == ids
    got, _ = runtime.greedy(session, cache, question, N_NEW)
    assert got == expected


def test_the_sliding_window_model_really_has_sliding_layers(case):
    _, path, *_ = case
    if "Gemma" in str(path):
        assert _kinds(path) == {artifact.FULL_ATTENTION, artifact.SLIDING_WINDOW}


def test_load_tensors_is_bitwise_the_file_in_both_read_modes(case):
    from safetensors.torch import load_file

    _, path, *_ = case
    reference = load_file(str(path))
    for direct in (True, False):
        tensors = artifact.load_tensors(artifact.read_header(path), direct=direct)
        assert tensors.keys() == reference.keys()
        for name, t in reference.items():
            assert tensors[name].dtype == t.dtype and tensors[name].equal(t), (direct, name)


def test_the_model_starts_before_the_last_layer_is_read(case, verifiers, monkeypatch):
    """Pipelining, shown without a clock: every read past the first layer of each kind (the masks
    are sized from them) is held until the model's first decoder layer has started, so that layer
    must run while later layers are still unread; a model that waited for the whole cache first
    would leave the reads held."""
    session, path, _, question, expected = case
    layers = artifact.read_header(path).manifest["layers"]
    firsts = {
        kind: next(i for i, layer in enumerate(layers) if layer["kind"] == kind)
        for kind in {layer["kind"] for layer in layers}
    }
    assert max(firsts.values()) < len(layers) - 1  # something is left to overlap
    first_layer = [name for i in range(max(firsts.values()) + 1) for name in layers[i]["tensors"].values()]
    layer_zero_runs = threading.Event()
    held = []
    read_piece = tensor_io.TensorReader._read_piece

    def slow_read(self, start, end):
        if start >= max(self.span(name)[1] for name in first_layer):
            held.append(layer_zero_runs.wait(timeout=budget(10)))
        return read_piece(self, start, end)

    monkeypatch.setattr(tensor_io.TensorReader, "_read_piece", slow_read)
    hook = session.model.model.layers[0].register_forward_pre_hook(lambda *_: layer_zero_runs.set())
    try:
        cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=True)
        got, _ = runtime.greedy(session, cache, question, N_NEW)
    finally:
        hook.remove()
    assert got == expected
    assert held and all(held), "the model did not start on layer 0 while later layers were unread"


def test_layers_are_read_in_layer_order_several_at_a_time(case, verifiers, monkeypatch):
    """The file holds tensors by name (layers.10 before layers.2); the stream asks for them in layer
    order, with more than one read in flight."""
    session, path, *_ = case
    in_flight, most, order = [0], [0], []
    lock = threading.Lock()
    fetch_groups = tensor_io.TensorReader.fetch_groups
    read_piece = tensor_io.TensorReader._read_piece

    def counted_read(self, start, end):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            threading.Event().wait(0.01)  # long enough for the next reads to start
            return read_piece(self, start, end)
        finally:
            with lock:
                in_flight[0] -= 1

    def recorded_groups(self, groups):
        for index, error in fetch_groups(self, groups):
            order.append(index)
            yield index, error

    monkeypatch.setattr(tensor_io.TensorReader, "_read_piece", counted_read)
    monkeypatch.setattr(tensor_io.TensorReader, "fetch_groups", recorded_groups)
    cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=True)
    list(cache.layers)  # waits for every layer
    assert order == list(range(len(cache.layers)))
    assert most[0] > 1, "one read at a time"


def _corrupt_last_layer(path, tmp_path):
    """A copy of the artifact with one byte of its last layer's value tensor (its codes, when
    quantized) flipped."""
    header = artifact.read_header(path)
    last = header.manifest["layers"][-1]["tensors"]["value"]
    start, end = header.entries[last]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[header.data_start + (start + end) // 2] ^= 0x40
    bad = tmp_path / "bad.kv"
    bad.write_bytes(bytes(data))
    return bad, len(header.manifest["layers"]) - 1


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_corrupted_layer_fails_loudly_and_is_never_used(case, tmp_path, direct, verifiers, monkeypatch):
    session, path, _, question, _ = case
    bad, last = _corrupt_last_layer(path, tmp_path)
    original = tensor_io.TensorReader.__init__
    monkeypatch.setattr(
        tensor_io.TensorReader, "__init__", lambda self, header, _direct=None: original(self, header, direct)
    )
    with pytest.raises(ArtifactError, match="blake3 mismatch"):
        runtime.load_cache(session, artifact.read_header(bad))
    cache, _ = runtime.load_cache(session, artifact.read_header(bad), stream=True)
    with pytest.raises(ArtifactError, match=f"blake3 mismatch in layer {last} "):
        runtime.greedy(session, cache, question, N_NEW)
    # The bad layer was never imported: its cache layer is still empty.
    assert not _layer_filled(cache, last)


def test_concurrent_loads_share_the_pools_and_stay_exact(case, tmp_path, verifiers):
    """Loads in several threads at once (as the server's requests do) share the process's reader
    and hashing pools: every good load is bitwise the file, every load of a corrupted copy fails,
    and neither disturbs the other."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    session, path, *_ = case
    bad, _ = _corrupt_last_layer(path, tmp_path)
    reference = load_file(str(path))

    def good(stream: bool) -> list[str]:
        cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=stream)
        list(cache.layers)  # a streamed load: wait for every layer
        _, tensors = session.adapter.export_cache(session.model, cache)
        return [name for name, t in tensors.items() if not t.equal(reference[name])]

    def corrupted(stream: bool) -> str:
        try:
            cache, _ = runtime.load_cache(session, artifact.read_header(bad), stream=stream)
            list(cache.layers)
        except ArtifactError as exc:
            return str(exc)
        return "loaded"

    with ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(good, i % 2 == 1) for i in range(8)]
        bads = [pool.submit(corrupted, i % 2 == 1) for i in range(4)]
        raw = [pool.submit(artifact.load_tensors, artifact.read_header(path)) for _ in range(4)]
    assert [f.result() for f in goods] == [[]] * 8  # every tensor of every good load is the file's
    assert all("blake3 mismatch" in f.result() for f in bads), [f.result() for f in bads]
    for f in raw:
        tensors = f.result()
        assert tensors.keys() == reference.keys() and all(tensors[n].equal(t) for n, t in reference.items())


def _layer_filled(cache, index) -> bool:
    layer = cache.layers.unchecked()[index]
    return getattr(layer, "keys", None) is not None and layer.keys.numel() > 0


def test_a_truncated_file_fails_the_streamed_load(case, tmp_path, verifiers):
    """Cut after its header was read: the reader hits the end early and the model is told."""
    session, path, _, question, _ = case
    header = artifact.read_header(path)
    short = tmp_path / "short.kv"
    short.write_bytes(path.read_bytes()[: header.file_size - 4096])
    cut = artifact.Header(short, header.manifest, header.entries, header.data_start, header.file_size)
    cache, _ = runtime.load_cache(session, cut, stream=True)
    with pytest.raises(ArtifactError, match="truncated"):
        runtime.greedy(session, cache, question, N_NEW)


def test_a_streamed_cache_copies_and_crops_like_a_plain_one(case, verifiers):
    session, path, ids, question, expected = case
    cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=True)
    twin = copy.deepcopy(cache)  # waits for the whole load, then a plain list of layers
    assert type(twin.layers) is list
    assert runtime.greedy(session, twin, question, N_NEW)[0] == expected
    assert runtime.greedy(session, cache, question, N_NEW)[0] == expected


def _imports(session, monkeypatch) -> list[tuple[int, str]]:
    """``(layer index, thread name)`` of every ``import_layer`` call from now on."""
    calls: list[tuple[int, str]] = []
    adapter_cls = type(session.adapter)
    original = adapter_cls.import_layer

    def import_layer(self, entry, named, layer):
        calls.append((entry.index, threading.current_thread().name))
        return original(self, entry, named, layer)

    monkeypatch.setattr(adapter_cls, "import_layer", import_layer)
    return calls


def test_workers_finish_the_layers_read_before_the_model_asks(case, verifiers, monkeypatch):
    session, path, _, question, expected = case
    calls = _imports(session, monkeypatch)
    cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=True)
    stream = cache.layers.stream
    stream.thread.join(timeout=budget(30))  # every byte read and every layer finished before the model starts
    assert runtime.greedy(session, cache, question, N_NEW)[0] == expected
    assert sorted(index for index, _ in calls) == list(range(len(stream.layers)))  # each once
    assert all(name.startswith("kvcdn-layer") for _, name in calls), calls


def test_the_model_thread_finishes_a_layer_no_worker_has_started(case, verifiers, monkeypatch):
    """Workers held back: the model's thread verifies and imports every layer itself, once each,
    and the workers, let go afterwards, find them done."""
    from kvcdn_core.artifact.layer_stream import LayerStream

    session, path, _, question, expected = case
    calls = _imports(session, monkeypatch)
    model_done = threading.Event()
    finish = LayerStream._finish

    def held_finish(self, index):
        if threading.current_thread().name.startswith("kvcdn-layer"):
            model_done.wait(timeout=budget(30))
        finish(self, index)

    monkeypatch.setattr(LayerStream, "_finish", held_finish)
    cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=True)
    try:
        assert runtime.greedy(session, cache, question, N_NEW)[0] == expected
    finally:
        model_done.set()
    cache.layers.stream.thread.join(timeout=budget(30))
    assert sorted(index for index, _ in calls) == list(range(len(cache.layers.stream.layers)))
    assert {name for _, name in calls} == {threading.current_thread().name}


def test_without_a_spare_core_the_load_is_whole(case, monkeypatch):
    from kvcdn_core import cores

    session, path, _, question, expected = case
    monkeypatch.setattr(cores, "stream_workers", lambda _torch_threads: 0)
    cache, _ = runtime.load_cache(session, artifact.read_header(path), stream=True)
    assert not isinstance(cache.layers, GatedLayers)
    assert runtime.greedy(session, cache, question, N_NEW)[0] == expected


def test_adapters_that_reshape_the_cache_load_whole(case):
    from kvcdn_core import ModelAdapter

    session, path, *_ = case
    layers = Manifest.from_dict(artifact.read_header(path).manifest).layers
    assert session.adapter.streams_layers(layers)
    assert not session.adapter.streams_layers([*layers, LayerEntry(len(layers), artifact.RECURRENT_STATE)])

    class Reshaping(type(session.adapter)):
        def import_cache(self, model, layers, tensors, device):
            return ModelAdapter.import_cache(self, model, layers, tensors, device)

    assert not Reshaping().streams_layers(layers)


def test_continue_streams_and_refuses_a_corrupted_layer_in_one_line(
    cli, qwen3_dir, qwen3_artifact, tmp_path, verifiers
):
    good = cli("continue", "--kv-path", qwen3_artifact, "--model", qwen3_dir, "--n", "4", "--format", "json")
    assert good.exit_code == 0, good.stderr
    bad, last = _corrupt_last_layer(qwen3_artifact, tmp_path)
    result = cli("continue", "--kv-path", bad, "--model", qwen3_dir, "--n", "4")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and f"blake3 mismatch in layer {last} " in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# -- quantized artifacts, streamed -----------------------------------------------------------------

QUANT_SCHEMES = ["int8", "int8-tensor", "fp8"]


@pytest.fixture(scope="module")
def quantized(case, tmp_path_factory):
    """The case's artifact quantized with each core scheme (the code path of `kvcdn quant`)."""
    from kvcdn_core.plugin_host.registry import quantizer_for

    _, path, *_ = case
    header = artifact.read_header(path)
    folder = tmp_path_factory.mktemp("quantized")
    out = {}
    for scheme in QUANT_SCHEMES:
        result = codec.quantize_cache(header.manifest, artifact.load_tensors(header), quantizer_for(scheme)())
        out[scheme] = artifact.write_artifact(folder / f"ctx.{scheme}.kv", result.manifest, result.tensors)
    return out


def _layer_state(layer) -> dict:
    return {
        name: getattr(layer, name)
        for name in ("keys", "values", "cumulative_length", "sliding_window")
        if getattr(layer, name, None) is not None
    }


@pytest.mark.parametrize("scheme", QUANT_SCHEMES)
def test_a_streamed_quantized_load_equals_the_whole_load(case, quantized, scheme, verifiers):
    """Tensor for tensor (every layer's keys, values and sliding-window state), then token for
    token and logit for logit of the continuation."""
    import torch

    session, _, ids, question, _ = case
    header = artifact.read_header(quantized[scheme])
    assert header.manifest["quantization"]["scheme"] == scheme
    whole, whole_ids = runtime.load_cache(session, header, stream=False)
    streamed, streamed_ids = runtime.load_cache(session, artifact.read_header(quantized[scheme]), stream=True)
    assert isinstance(streamed.layers, GatedLayers) and not isinstance(whole.layers, GatedLayers)
    assert streamed_ids == whole_ids == ids
    assert len(streamed.layers) == len(whole.layers) == len(header.manifest["layers"])
    for index, (a, b) in enumerate(zip(whole.layers, streamed.layers)):
        state_a, state_b = _layer_state(a), _layer_state(b)
        assert state_a.keys() == state_b.keys() and {"keys", "values"} <= state_a.keys(), index
        for name, value in state_a.items():
            if hasattr(value, "dtype"):
                assert value.dtype == state_b[name].dtype == getattr(torch, session.dtype)
                assert value.shape == state_b[name].shape and value.equal(state_b[name]), (index, name)
            else:
                assert value == state_b[name], (index, name)
    got_whole, logits_whole = runtime.greedy(session, whole, question, N_NEW)
    got_streamed, logits_streamed = runtime.greedy(session, streamed, question, N_NEW)
    assert got_streamed == got_whole
    assert all(a.equal(b) for a, b in zip(logits_whole, logits_streamed))


def test_a_corrupted_quantized_layer_fails_only_when_reached(case, quantized, tmp_path, verifiers):
    """int8 with the last layer's value codes corrupted: the whole load refuses the file; the
    streamed load hands out every earlier layer, and fails on the last one when the model gets there."""
    session, _, _, question, _ = case
    bad, last = _corrupt_last_layer(quantized["int8"], tmp_path)
    with pytest.raises(ArtifactError, match="blake3 mismatch"):
        runtime.load_cache(session, artifact.read_header(bad))
    cache, _ = runtime.load_cache(session, artifact.read_header(bad), stream=True)
    for index in range(last):
        assert cache.layers[index].keys.numel() > 0  # verified, dequantized, usable
    with pytest.raises(ArtifactError, match=f"blake3 mismatch in layer {last} "):
        cache.layers[last]
    with pytest.raises(ArtifactError, match=f"blake3 mismatch in layer {last} "):
        runtime.greedy(session, cache, question, N_NEW)
    assert not _layer_filled(cache, last)
