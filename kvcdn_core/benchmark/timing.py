"""How the benchmark times things: warm-up then reps, min/median/max, and the physical limits
(a plain read of the file, the FLOPs of a prefill) its measurements are held to."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def sync(device: str) -> None:
    """Wait for the device's queued work, so that a timer stops when the work is done."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def stat(times: list[float]) -> tuple[float, float, float]:
    return min(times), statistics.median(times), max(times)


def timed_runs(fn: Callable[[], Any], reps: int, tick: Callable[[], None], warmup=None) -> tuple[tuple, Any]:
    """One warm-up (``warmup`` or ``fn``, discarded), then ``reps`` timed calls of ``fn``;
    ``((min, median, max) s, last result)``."""
    (warmup or fn)()
    tick()
    times, last = [], None
    for _ in range(reps):
        start = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - start)
        tick()
    return stat(times), last


def load_average() -> float | None:
    """The 1-minute load average, to tell a quiet run from a busy one."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def plain_read(path: Path) -> int:
    """Read a whole file into memory the simplest fast way: the physical limit a load is held to.

    Same buffer as :func:`kvcdn_core.artifact.load_tensors` (uninitialised numpy, huge pages where
    offered), so the two differ only by what loading adds: hashing, tensor views, the cache.
    """
    import numpy as np

    size = os.path.getsize(path)
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer.data)
    done = 0
    with open(path, "rb", buffering=0) as fh:
        while done < size:
            n = fh.readinto(view[done:])
            if not n:
                break
            done += n
    return done


def attention_flops(config, tokens: int) -> float:
    """Causal attention score and weighted-sum FLOPs of one prefill (SDPA is not op-counted on CPU)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    layers = getattr(text, "num_hidden_layers", 0) or 0
    pairs = tokens * (tokens + 1) / 2
    return 2 * 2 * layers * heads * head_dim * pairs


def count_matmul_flops(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` under torch's FLOP counter; ``(matmul FLOPs, result)``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = fn()
    return float(counter.get_total_flops()), result
