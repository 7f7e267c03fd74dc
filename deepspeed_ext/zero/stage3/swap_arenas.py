"""Host buffers that optimizer sub-groups are read into, reused by the sub-groups after them.

[Note: sub-group arenas]
A sub-group of masters and their optimizer states read from NVMe goes into one page-aligned
arena, each tensor carved at an offset of the aio op's alignment (so its O_DIRECT reads need
no bounce copy). When the sub-group has been written back, its arena serves the next one
read, instead of each tensor getting fresh memory that the kernel must fault in and zero
(measured: about a tenth of the forward with step_in_forward on the 48M GPT, 2 ranks,
docs/benchmarks.md). Spare arenas are freed once the sub-groups of one step have all stepped
(`release_spare`; with steps in the forward, after the last of them, whose own arena goes
when its write is waited), so that between steps memory holds no more than without them.
A checkpoint reads everything in the step's sub-groups, each in an arena of its own, so
that a caching (pinned) host allocator gets back blocks of the sizes the steps ask for.
Whoever drops a sub-group must hold no view of its arena after: ParamSwap copies a value
handed over from a master when the arena goes back while a read-ahead still counts on it,
and a gather runs its shards' pending steps before it reads any of them (a later shard's
step would hand an earlier shard's value, already read, to the next sub-group's read).
"""

from __future__ import annotations

import torch

from deepspeed_ext.zero.offload.nvme import NVMeSwapper

ALIGN = 4096  # the aio op's O_DIRECT alignment (csrc/aio/aio_file.h kAlign)
_SPARE_MAX = 3  # sub-groups in memory at once with pipelined swapping


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class SwapArenas:
    def __init__(self, swapper: NVMeSwapper) -> None:
        self.swapper = swapper
        self._spare: list[torch.Tensor] = []
        self._largest = 0  # bytes: new arenas are made this big, so that later groups fit
        self.stats = {"arenas_made": 0, "arenas_reused": 0}

    def carve(
        self, shapes: list[tuple[int, torch.dtype]], exact: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """An arena holding tensors of (numel, dtype) each, and those tensors (1-D views).
        exact: a new arena holds just these (a step of other sub-groups than the ones
        sizing the arenas), instead of the largest size made since release_spare()."""
        nbytes = [n * d.itemsize for n, d in shapes]
        arena = self._take(max(ALIGN, sum(_aligned(b) for b in nbytes)), exact)
        views, off = [], 0
        for (_, dtype), b in zip(shapes, nbytes):
            views.append(arena[off : off + b].view(dtype))
            off += _aligned(b)
        return arena, views

    def give(self, arena: torch.Tensor) -> None:
        """The arena's tensors are done with (written back and dropped): reusable."""
        self._spare.append(arena)
        if len(self._spare) > _SPARE_MAX:
            self._spare.sort(key=lambda a: a.numel())
            self.swapper.release(self._spare.pop(0))

    def release_spare(self) -> None:
        for arena in self._spare:
            self.swapper.release(arena)
        self._spare = []
        self._largest = 0  # the next step's sub-groups set it again (not a checkpoint's all)

    def _take(self, nbytes: int, exact: bool = False) -> torch.Tensor:
        fits = [a for a in self._spare if a.numel() >= nbytes]
        if fits:
            best = min(fits, key=lambda a: a.numel())
            self._spare = [a for a in self._spare if a is not best]  # not list.remove: ==
            self.stats["arenas_reused"] += 1
            return best
        self.stats["arenas_made"] += 1
        if exact:
            return self.swapper.empty(nbytes, torch.uint8)
        self._largest = max(self._largest, nbytes)
        return self.swapper.empty(self._largest, torch.uint8)
