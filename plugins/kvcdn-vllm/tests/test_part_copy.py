"""A load's part as the copying thread reads it (``kvcdn_vllm.layers.PartCopy``), without vLLM: each
tensor's rows are views of the chunk's own bytes, made when asked, readable once that tensor's
bytes have landed, whatever the dtypes before it."""

from __future__ import annotations

import threading

import pytest
import torch
from kvcdn_vllm.layers import PartCopy
from kvcdn_vllm.lookup import ChunkPlan, Part, TensorSlot
from kvcdn_vllm.tier import MEMORY, Arrival

from kvcdn_core.errors import ArtifactError

TOKENS = 5  # odd, so a float16 tensor of one head of 3 channels ends on an odd number of bytes


def chunk(slots: list[TensorSlot], seed: int = 0) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A part's bytes (the tensors one after another, as a chunk holds them) and each tensor."""
    g = torch.Generator().manual_seed(seed)
    tensors = {s.name: torch.randn(s.outer, TOKENS, s.last, generator=g).to(getattr(torch, s.dtype)) for s in slots}
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values()), tensors


SLOTS = [
    TensorSlot("a", 1, 3, "float16"),  # 30 bytes: the next tensor starts off a 4-byte boundary
    TensorSlot("b", 2, 4, "float32"),
    TensorSlot("c", 2, 4, "bfloat16"),
    TensorSlot("d", 1, 2, "float32"),
]


def copy_of(data_size: int, arrival: Arrival, start: int = 0, end: int = TOKENS) -> PartCopy:
    plan = ChunkPlan("doc", tuple(SLOTS), (Part("x" * 64, 0, TOKENS, data_size),))
    return PartCopy("job", plan, plan.parts[0], arrival, start, end, lambda name, kv: None)  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(("start", "end"), [(0, TOKENS), (2, 4), (4, 5)])
def test_views_are_each_tensors_rows_whatever_the_dtypes_before_it(start, end):
    data, tensors = chunk(SLOTS)
    arrival = Arrival(len(data))
    arrival.settle(data, MEMORY)  # read-only bytes, as a memory hit hands them out
    copy = copy_of(len(data), arrival, start, end)
    for name in ("d", "a", "c", "b"):  # any order, any number at a time
        (view,) = copy.views(name)
        assert view.dtype == tensors[name].dtype
        assert torch.equal(view, tensors[name][:, start:end])
    b, c = copy.views("b", "c")
    assert torch.equal(b, tensors["b"][:, start:end]) and torch.equal(c, tensors["c"][:, start:end])


def test_a_tensor_is_readable_once_its_own_bytes_have_landed():
    data, tensors = chunk(SLOTS, seed=1)
    arrival = Arrival(len(data))
    into = memoryview(bytearray(len(data)))
    landed = arrival.landing(into)
    copy = copy_of(len(data), arrival)
    a_end = 1 * TOKENS * 3 * 2
    b_end = a_end + 2 * TOKENS * 4 * 4
    into[:b_end] = data[:b_end]
    landed(b_end)  # "a" and "b" are in; "c" and "d" are not
    front: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: front.extend(copy.views("a", "b")), daemon=True)
    reader.start()
    reader.join(timeout=60)  # a bound on a failure only: it returns at once
    assert not reader.is_alive(), "views of landed bytes waited for the rest of the chunk"
    assert torch.equal(front[0], tensors["a"]) and torch.equal(front[1], tensors["b"])

    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.extend(copy.views("a", "c")), daemon=True)
    reader.start()
    reader.join(timeout=0.2)
    assert not got  # waits for the bytes of every tensor named, the last one's too
    into[b_end:] = data[b_end:]
    landed(len(data))
    reader.join()
    assert torch.equal(got[0], tensors["a"]) and torch.equal(got[1], tensors["c"])


def test_a_fetch_that_failed_fails_the_views_of_bytes_it_did_not_bring():
    data, _ = chunk(SLOTS, seed=2)
    arrival = Arrival(len(data))
    into = memoryview(bytearray(len(data)))
    into[:30] = data[:30]
    arrival.landing(into)(30)
    arrival.fail(ArtifactError("the store: a dropped connection"))
    with pytest.raises(ArtifactError, match="dropped connection"):
        copy_of(len(data), arrival).views("a")
