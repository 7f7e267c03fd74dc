"""Optimizer steps inside the backward pass, for optimizer state on NVMe.

[Note: optimizer steps in backward]
offload_optimizer.step_in_backward (a deepspeed_ext key; NVMe only): at an accumulation
boundary, a master whose gradient partition is final steps during the backward, not after it.
A partition is final when its parameter's last reduce-scatter of that backward is done. The
reads and writes of its state then overlap the rest of the backward's compute, instead of
making up the step. Without it, the NVMe step is disk-bound: a rank reads and writes 24 bytes
per parameter (fp32 master and two moments) while nothing else runs.
- Masters collect into sub-groups of at least sub_group_size elements, in the order their
  gradients complete. When one fills, its state starts to be read (async). When the next one
  fills, the earlier one, read by then, steps and starts to be written (async), and the new
  one's read starts. At most three sub-groups are in memory, as with pipelined swapping.
- engine.step() steps what is left: the sub-group being read, then the one still filling
  together with the tied parameters, which get a gradient per use ([Note: per-use aliases
  of tied parameters]), read while the first steps; then any parameter with no gradient.
  It reports the gradient norm as always.
- Exact, not approximate: Adam(W) updates each element from its own gradient and state, and
  the step's learning rate is set before the backward. So the config refuses the key with
  gradient clipping, which needs the global norm before any update, and with overflow checks
  (fp16, bf16.check_grad_overflow), which may skip a step after the fact.
- A backward made with loss.backward() instead of engine.backward() steps nothing early (the
  engine does not know it is at a boundary); engine.step() then steps it all, as without
  the key, and a warning says so once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .nvme import OptimizerSwap


class BackwardSteps:
    def __init__(self, swap: OptimizerSwap, late: set[int]) -> None:
        self.swap = swap
        self.late = late  # master indices that only engine.step() steps
        self.open = False
        self.done: set[int] = set()
        self._filling: list[int] = []
        self._filling_numel = 0
        self._reading: list[int] = []
        self._writing: list[int] = []
        swap.stats.setdefault("stepped_in_backward", 0)  # sub-groups

    def begin(self) -> None:
        """A boundary backward starts."""
        self.open = True
        self.done = set()

    def reduced(self, indices: list[int], grad_of: Callable[[int], torch.Tensor]) -> None:
        """These masters' gradient partitions are final (called from the backward)."""
        for i in indices:
            if i in self.late or i in self.done or i in self._filling:
                continue
            self._filling.append(i)
            self._filling_numel += self.swap.params[i].ds_shard_numel
        if self._filling_numel >= self.swap.sub_group_numel:
            self._advance(grad_of, self._filling)
            self._filling, self._filling_numel = [], 0

    def _advance(
        self, grad_of: Callable[[int], torch.Tensor], nxt: list[int], in_backward: bool = True
    ) -> None:
        """The sub-group being read steps and starts its write; `nxt` starts its read."""
        swap = self.swap
        if self._reading:
            swap.swapper.wait_reads(background=True)
            self._writing = swap.step_and_write(self._reading, self._writing, grad_of)
            self.done.update(self._reading)
            swap.stats["stepped_in_backward"] += in_backward
        self._reading = []
        if nxt:
            swap.read_group(nxt, background=True)
            self._reading = list(nxt)  # only once submitted: a failed submit leaves it unread

    def finish(self, grad_of: Callable[[int], torch.Tensor]) -> frozenset[int]:
        """engine.step(): steps the rest with the same overlap -- the sub-group being read,
        then the one still filling together with the tied masters, read while the first
        steps and is written -- and completes every write. Returns the masters stepped since
        begin(); any other (no gradient this step) is the caller's."""
        rest = self._filling + sorted(self.late)
        self._filling, self._filling_numel = [], 0
        self._advance(grad_of, rest, in_backward=False)
        self._advance(grad_of, [], in_backward=False)
        self.swap.end_writes(self._writing)
        self._writing = []
        self.open = False
        return frozenset(self.done)
