"""partition_activations: a checkpoint's saved inputs split across the tensor-parallel group.

[Note: partitioned checkpoints]
Between sliced layers the activations are whole on every rank of a tensor-parallel group, so
a checkpointed block's inputs are the same tensor tp times over. With partition_activations
each rank keeps 1/tp of each saved floating-point input (flattened, zero-padded to a multiple
of tp) and the backward all-gathers the parts before the recompute. With
contiguous_memory_optimization the parts live in one preallocated buffer per dtype and
device, `number_checkpoints` slots of the first part's size, handed out in order and reused
once every part saved since the buffer was last empty has been gathered back (a forward's
checkpoints, then their recomputes); a part that does not fit gets its own tensor, said once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.comm import AxisGroup, all_gather
from deepspeed_ext.utils.logging import logger

from . import settings


@dataclass
class Part:
    data: torch.Tensor  # this rank's chunk (padded), possibly a slot of an arena
    shape: torch.Size
    numel: int
    device: torch.device  # where the whole tensor lives (the chunk may be on the host)
    arena: Any = None  # the arena whose slot holds it, released when gathered


class _Arena:
    def __init__(self, slots: int, numel: int, like: torch.Tensor) -> None:
        self.buf = torch.empty(slots * numel, dtype=like.dtype, device=like.device)
        self.slots, self.numel = slots, numel
        self.next = 0  # the next free slot
        self.live = 0  # parts handed out and not yet gathered back

    def take(self, chunk: torch.Tensor) -> torch.Tensor | None:
        if chunk.numel() > self.numel or self.next >= self.slots:
            return None
        slot = self.buf.narrow(0, self.next * self.numel, chunk.numel())
        slot.copy_(chunk)
        self.next += 1
        self.live += 1
        return slot

    def release(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.next = 0


_arenas: dict[tuple[torch.dtype, torch.device], _Arena] = {}
_said_full = False


def _store(chunk: torch.Tensor) -> tuple[torch.Tensor, Any]:
    global _said_full
    s = settings.current()
    if not s.contiguous_memory_optimization:
        return chunk, None
    key = (chunk.dtype, chunk.device)
    arena = _arenas.get(key)
    if arena is None:
        arena = _arenas[key] = _Arena(int(s.number_checkpoints or 1), chunk.numel(), chunk)
    slot = arena.take(chunk)
    if slot is None:
        if not _said_full:
            logger.warning(
                "activation_checkpointing.contiguous_memory_optimization: a saved part did not "
                f"fit the buffer of {arena.slots} slots x {arena.numel} elements "
                "(number_checkpoints, and the first checkpoint's size); it got its own tensor"
            )
            _said_full = True
        return chunk, None
    return slot, arena


def split(t: torch.Tensor, axis: AxisGroup) -> Part | torch.Tensor:
    """This rank's part of a saved input (small and non-float tensors stay whole)."""
    if not t.is_floating_point() or t.numel() < axis.size:
        return t.detach()
    flat = t.detach().reshape(-1)
    n = -(-flat.numel() // axis.size)
    lo, hi = axis.rank * n, min((axis.rank + 1) * n, flat.numel())
    chunk = flat.new_zeros(n)
    if hi > lo:
        chunk[: hi - lo].copy_(flat[lo:hi])
    data, arena = _store(chunk)
    return Part(data, t.shape, t.numel(), t.device, arena)


def join(x: Part | torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """The whole saved input again (collective over the tensor group for a Part)."""
    if not isinstance(x, Part):
        return x
    mine = x.data.to(x.device, non_blocking=True).contiguous()
    parts = [torch.empty_like(mine) for _ in range(axis.size)]
    all_gather(parts, mine, group=axis)
    if x.arena is not None:
        x.arena.release()
    return torch.cat(parts)[: x.numel].view(x.shape)


def free_buffers() -> None:
    """deepspeed.checkpointing.reset(): drop the contiguous buffers (an evaluation pass that
    never runs the backward would otherwise leave slots taken)."""
    _arenas.clear()
