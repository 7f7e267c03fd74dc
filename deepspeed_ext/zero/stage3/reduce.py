"""Stage-3 gradients into their owners' shards.

[Note: stage-3 gradient reduction]
Each trainable parameter's post-accumulate-grad hook hands its fresh full .grad here and frees
it. Gradients are packed, in the order they become ready (the same on every rank: the same
graph), into a [W, S_total] buffer, row r holding every parameter's shard r; once the pending
elements reach the bucket size, one reduce-scatter leaves this rank's row, summed over ranks,
which is added (averaged) into each parameter's shard-sized gradient partition. At most
`max_in_flight` buffers exist at once, so no rank holds the full gradients. Whatever is
pending when backward ends is flushed by end_backward().
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from deepspeed_ext.comm import MEAN, AxisGroup, GradAverage, reduce_scatter_bucket

from .gather import fill_rows


class Stage3Reducer:
    def __init__(
        self,
        params: list[Any],
        accum_dtype: torch.dtype,
        grad_device: torch.device,
        bucket_numel: int,
        group: AxisGroup,
        max_in_flight: int = 2,
        averaging: GradAverage = MEAN,
        scatter: Any = reduce_scatter_bucket,
    ) -> None:
        self.group = group  # data-parallel
        self.scatter = scatter  # [Note: ZeRO communication keys]
        self.world = group.size
        self.before, self.after = averaging.factors(self.world)
        self.accum_dtype = accum_dtype
        self.bucket_numel = max(1, bucket_numel)
        self.max_in_flight = max_in_flight
        pin = grad_device.type == "cpu" and any(p.ds_device.type != "cpu" for p in params)
        # part[id(p)]: [S] this rank's shard of p's gradient, accumulated over micro-steps
        self.part = {
            id(p): torch.zeros(
                p.ds_shard_numel, dtype=accum_dtype, device=grad_device, pin_memory=pin
            )
            for p in params
        }
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.pending_numel = 0
        self.in_flight: deque[tuple[Any, torch.Tensor, list[Any]]] = deque()

    def add(self, p: Any, grad: torch.Tensor) -> None:
        self.pending.append((p, grad))
        self.pending_numel += p.ds_shard_numel * self.world
        if self.pending_numel >= self.bucket_numel:
            self._launch()

    def _launch(self) -> None:
        if not self.pending:
            return
        items, self.pending, self.pending_numel = self.pending, [], 0
        total = sum(p.ds_shard_numel for p, _ in items)
        device = items[0][1].device
        buf = torch.zeros(self.world, total, dtype=self.accum_dtype, device=device)
        off = 0
        for p, g in items:
            s = p.ds_shard_numel
            fill_rows(buf[:, off : off + s], g.reshape(-1))
            off += s
        # this rank's row of the bucket: the reduce-scatter runs in place (no output buffer)
        out = buf[self.group.rank]
        if self.before != 1:
            buf.mul_(self.before)
        work = self.scatter(out, buf.view(-1), group=self.group)
        self.in_flight.append((work, out, [p for p, _ in items]))
        while len(self.in_flight) > self.max_in_flight:
            self._complete()

    def _complete(self) -> None:
        work, out, params = self.in_flight.popleft()
        work.wait()
        off = 0
        for p in params:
            s = p.ds_shard_numel
            part = self.part[id(p)]
            part.add_(out[off : off + s].to(part.device), alpha=self.after)
            off += s

    def flush(self) -> None:
        self._launch()
        while self.in_flight:
            self._complete()

    def grads(self) -> list[torch.Tensor]:
        return list(self.part.values())

    def zero(self) -> None:
        for g in self.part.values():
            g.zero_()
