"""Tensor parallelism without vLLM: the heads each rank holds, and gathering them back whole.

The gather runs on torch.distributed's gloo backend in two real processes, as vLLM's TP group's CPU
group does on a CPU or a GPU engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kvcdn_vllm.parallel import HeadGather, assemble, head_owners, head_selection

TOKENS, DIM, LAYERS = 37, 8, 3


def prompt(heads: int, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        i: (torch.randn(heads, TOKENS, DIM, generator=g), torch.randn(heads, TOKENS, DIM, generator=g))
        for i in range(LAYERS)
    }


def rank_part(full: torch.Tensor, total: int, tp: int, rank: int) -> torch.Tensor:
    """What vLLM's rank ``rank`` holds of ``full`` (heads first): ``max(1, total // tp)`` heads."""
    return full[head_selection(total, max(1, total // tp), tp, rank)]


@pytest.mark.parametrize(
    ("total", "tp", "owners"),
    [
        (2, 2, [0, 1]),
        (4, 2, [0, 1]),
        (8, 4, [0, 1, 2, 3]),
        (3, 3, [0, 1, 2]),
        (1, 2, [0]),
        (2, 4, [0, 2]),
        (2, 8, [0, 4]),
    ],
)
def test_each_rank_holds_its_heads_and_the_owners_assemble_every_head_once(total, tp, owners):
    full = torch.randn(total, TOKENS, DIM)
    parts = [rank_part(full, total, tp, r) for r in range(tp)]
    assert head_owners(total, tp) == owners
    assert all(p.shape[0] == max(1, total // tp) for p in parts)
    assert torch.equal(assemble(parts, total, dim=0), full)
    # the gathered layout: [layers, keys/values, heads, tokens, dim]
    stacked = [torch.stack([torch.stack([p, p + 1])]) for p in parts]
    assert torch.equal(assemble(stacked, total, dim=2), torch.stack([torch.stack([full, full + 1])]))


def test_heads_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match="hold 2 KV heads, the model has 4"):
        assemble([torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)], 4, dim=0)


def tp_worker(rank: int, tp: int, total: int, init: str, lacking: str | None, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        gather = HeadGather(dist.new_group(list(range(tp)), backend="gloo"), list(range(tp)), rank, total)
        mine = {}
        for seed, req_id in enumerate(["a", "b", "c"]):
            layers = {i: tuple(rank_part(t, total, tp, rank) for t in kv) for i, kv in prompt(total, seed).items()}
            if req_id == lacking and rank == tp - 1:
                del layers[LAYERS - 1]  # this rank could not read one layer of "b"
            mine[req_id] = layers
        got = gather.whole(mine, LAYERS)
        torch.save({"first": gather.first, "got": got}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("total", "tp"), [(2, 2), (1, 2)])  # split heads; one head replicated on both ranks
@pytest.mark.parametrize("lacking", [None, "b"])
def test_two_processes_gather_every_head_on_the_first_rank(tmp_path, total, tp, lacking):
    out = str(tmp_path / "got")
    mp.start_processes(
        tp_worker,
        args=(tp, total, f"file://{tmp_path / 'rendezvous'}", lacking, out),
        nprocs=tp,
        start_method="spawn",
        join=True,
    )
    first, other = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert first["first"] and not other["first"]
    assert other["got"] == {}  # only the first rank writes
    expected = ["a", "c"] if lacking == "b" else ["a", "b", "c"]  # a rank that lacks a layer: no save, no hang
    assert list(first["got"]) == expected
    for req_id in expected:
        whole = prompt(total, ["a", "b", "c"].index(req_id))
        assert sorted(first["got"][req_id]) == sorted(whole)
        for i, (keys, values) in whole.items():
            assert torch.equal(first["got"][req_id][i][0], keys)
            assert torch.equal(first["got"][req_id][i][1], values)
