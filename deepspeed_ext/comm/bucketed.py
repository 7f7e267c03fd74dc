"""Gradient all-reduce in flat buckets, launched while backward is still running.

[Note: gradient buckets]
Gradients are views into a few flat buffers of ~bucket_numel elements each, in the reverse of
parameter order (backward produces the last layers' grads first). The runtime calls
mark_ready(param) as each grad is final; when a bucket's last grad arrives its all-reduce is
launched asynchronously, overlapping the rest of backward (gloo and nccl both run async
work). Buckets are launched strictly in index order, so every rank issues the same sequence
of collectives even when its grads become ready in another order (a mismatch would hang).
wait() finishes them all and divides by the world size (the average, as DDP does; how and
where is the GradAverage's choice). The params of an MoE layer's experts spread over ranks go
to buckets of their own, summed over their expert-data-parallel group and divided by the
same data-parallel size ([Note: expert groups]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .averaging import MEAN, GradAverage
from .cast import in_dtype
from .checked import dist
from .expert_groups import ExpertGroups, expert_groups_of
from .hierarchical import NodeGroups, advance, all_reduce_hierarchical
from .layout import resolve


class GradBuckets:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        bucket_numel: int,
        dtype: torch.dtype,
        group: Any = None,
        averaging: GradAverage = MEAN,
        hierarchy: NodeGroups | None = None,
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        self.group, self.world = resolve(group)  # an AxisGroup: the data-parallel one
        self.comm_dtype = comm_dtype  # [Note: communication dtype]; None: the buckets' own
        # set: each bucket's sum by node ([Note: hierarchical all-reduce])
        self.hierarchy = hierarchy
        factors = averaging.factors(self.world) if self.world > 1 else (1.0, 1.0)
        self.before, self.after = factors
        # [bucket] -> flat buffer; params laid out in reverse order
        self.buffers: list[torch.Tensor] = []
        self.views: dict[torch.Tensor, torch.Tensor] = {}
        self._bucket_of: dict[torch.Tensor, int] = {}
        self._members: list[list[torch.Tensor]] = []
        # [bucket] -> the expert groups its params are reduced over; None: the data group
        self.experts: list[ExpertGroups | None] = []
        # open buckets by expert group name ("": dense), each with its groups
        open_: dict[str, tuple[ExpertGroups | None, list[torch.Tensor], int]] = {}
        for p in reversed(params):
            eg = expert_groups_of(p)
            key = eg.name if eg is not None else ""
            _, current, size = open_.pop(key, (eg, [], 0))
            current.append(p)
            size += p.numel()
            if size >= bucket_numel:
                self._add_bucket(current, size, dtype, eg)
            else:
                open_[key] = (eg, current, size)
        for eg, current, size in open_.values():  # an order every rank shares (same params)
            self._add_bucket(current, size, dtype, eg)
        self._pending: list[int] = [0] * len(self.buffers)
        self._next = len(self.buffers)  # next bucket to launch; all launched until start()
        self._works: list[Any] = []

    def _add_bucket(
        self,
        members: list[torch.Tensor],
        size: int,
        dtype: torch.dtype,
        experts: ExpertGroups | None,
    ) -> None:
        self.experts.append(experts)
        device = members[0].device
        buf = torch.zeros(size, dtype=dtype, device=device)
        offset = 0
        idx = len(self.buffers)
        for p in members:
            self.views[p] = buf[offset : offset + p.numel()].view_as(p)
            self._bucket_of[p] = idx
            offset += p.numel()
        self.buffers.append(buf)
        self._members.append(members)

    def grad_view(self, p: torch.Tensor) -> torch.Tensor:
        return self.views[p]

    def start(self) -> None:
        """Arm the buckets for one reduction (at a gradient-accumulation boundary)."""
        self._pending = [len(m) for m in self._members]
        self._next = 0
        self._works = []

    def mark_ready(self, p: torch.Tensor) -> None:
        if self.hierarchy is not None:  # hierarchical sums' next collectives, in order
            advance([seg for w in self._works for seg in getattr(w, "segments", ())])
        self._pending[self._bucket_of[p]] -= 1
        while self._next < len(self.buffers) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        if self.world > 1:
            if self.before != 1:
                self.buffers[b].mul_(self.before)
            hierarchy = self.hierarchy
            experts = self.experts[b]
            if experts is not None:  # an expert bucket: summed where its experts are copied
                if experts.expert_data.size > 1:
                    group = experts.expert_data.group
                    self._works.append(
                        in_dtype(
                            self.buffers[b],
                            self.comm_dtype,
                            lambda t: dist.all_reduce(t, group=group, async_op=True),
                        )
                    )
                return
            if hierarchy is not None:
                launch: Any = lambda t: all_reduce_hierarchical(t, hierarchy)  # noqa: E731
            else:
                launch = lambda t: dist.all_reduce(t, group=self.group, async_op=True)  # noqa: E731
            self._works.append(in_dtype(self.buffers[b], self.comm_dtype, launch))

    def wait(self) -> None:
        """Finish every bucket (launching those whose params got no gradient this step)."""
        while self._next < len(self.buffers):
            self._launch(self._next)
            self._next += 1
        for w in self._works:
            w.wait()
        self._works = []
        if self.after != 1:
            for buf in self.buffers:
                buf.mul_(self.after)

    def zero(self) -> None:
        for buf in self.buffers:
            buf.zero_()
