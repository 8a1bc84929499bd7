"""Tensor parallelism: which KV heads each worker holds, and one whole artifact from all of them.

vLLM splits a layer's KV heads across the tensor-parallel (TP) ranks in order: with ``total`` heads
and ``tp`` ranks, rank ``r`` holds heads ``[r * total/tp, (r + 1) * total/tp)``; when ``tp`` exceeds
``total``, each head is replicated on ``tp/total`` consecutive ranks. So:

- **Loading**: each worker copies only its own heads from the artifact (:func:`head_selection`).
- **Saving**: each worker reads its own heads' keys and values from its blocks, as one worker alone
  does. Then, in the connector's ``wait_for_save`` (once per step, after the forward), the TP
  group's CPU (gloo) group gathers them to the group's first rank (:class:`HeadGather`), which puts
  the heads back in order, one copy of a replicated head (:func:`assemble`), and saves exactly the
  artifact that a single worker would: the same tensors, names and manifest, so a prompt saved
  under TP serves an engine without TP and back.

Every rank takes part in every gather of a step, in the same order (all ranks see the same
connector metadata). A rank that could not read a prompt's layers says so in a first, small
collective, and then no rank gathers that prompt: a failed save never leaves another rank waiting.
"""

from __future__ import annotations

from typing import Any

import torch

#: one prompt's layers: layer index → (keys, values), each ``[kv_heads, tokens, head_size]``
Layers = dict[int, tuple[torch.Tensor, torch.Tensor]]


def head_selection(total: int, local: int, tp: int, rank: int) -> slice:
    """The artifact's KV heads that TP rank ``rank`` holds (``local`` of them; replicated when tp > heads)."""
    if tp == 1 or local == total:
        return slice(None)
    if total >= tp:
        return slice(rank * local, (rank + 1) * local)
    per_head = tp // total
    return slice(rank // per_head, rank // per_head + 1)


def head_owners(total: int, tp: int) -> list[int]:
    """The ranks whose heads, concatenated in this order, are every head once."""
    if total >= tp:
        return list(range(tp))
    return list(range(0, tp, tp // total))


def assemble(parts: list[torch.Tensor], total: int, dim: int) -> torch.Tensor:
    """The whole heads dimension from every rank's part (``parts[r]``: rank ``r``'s heads on ``dim``)."""
    whole = torch.cat([parts[r] for r in head_owners(total, len(parts))], dim=dim)
    if whole.shape[dim] != total:
        raise ValueError(f"the ranks' parts hold {whole.shape[dim]} KV heads, the model has {total}")
    return whole


class HeadGather:
    """Gathers saved prompts' heads from every rank of a TP group to its first rank."""

    def __init__(self, group: Any, ranks: list[int], rank_in_group: int, total_heads: int):
        self.group = group  # a CPU (gloo) process group: saved tensors are already on the CPU
        self.ranks = ranks  # global ranks of the group, in TP order
        self.rank_in_group = rank_in_group
        self.total_heads = total_heads

    @classmethod
    def of_engine(cls, total_heads: int) -> HeadGather | None:
        """The engine's TP group (None without tensor parallelism). Call on a worker."""
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        if tp.world_size == 1:
            return None
        return cls(tp.cpu_group, list(tp.ranks), tp.rank_in_group, total_heads)

    @property
    def first(self) -> bool:
        """The rank that writes the assembled artifact."""
        return self.rank_in_group == 0

    def whole(self, prompts: dict[str, Layers], num_layers: int) -> dict[str, Layers]:
        """Each prompt's layers with every head, on the first rank, for the prompts every rank read
        whole (``num_layers`` layers); the other ranks get ``{}``. ``prompts`` must list the same
        requests in the same order on every rank."""
        import torch.distributed as dist

        if not prompts:
            return {}
        ready = torch.tensor([int(len(layers) == num_layers) for layers in prompts.values()], dtype=torch.int32)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=self.group)
        out: dict[str, Layers] = {}
        for ok, (req_id, layers) in zip(ready.tolist(), prompts.items()):
            if not ok:
                continue
            indices = sorted(layers)
            mine = torch.stack([torch.stack(layers[i]) for i in indices])  # [layers, 2, heads, tokens, dim]
            parts = [torch.empty_like(mine) for _ in self.ranks] if self.first else None
            dist.gather(mine, parts, dst=self.ranks[0], group=self.group)
            if parts is not None:
                full = assemble(parts, self.total_heads, dim=2)
                out[req_id] = {i: (full[n, 0], full[n, 1]) for n, i in enumerate(indices)}
        return out
