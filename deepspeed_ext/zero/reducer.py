"""Gradients into partitions: per-bucket buffers, reduce-scattered to their owners.

[Note: ZeRO gradient reduction]
A post-accumulate-grad hook adds each param's fresh .grad into its bucket buffer (in the
accumulation dtype) and frees .grad. Stage 1 keeps the full bucket buffers (the ZeRO-1 2Psi of
gradients) and reduce-scatters them once per accumulation window; the result lands in this
rank's own chunk of the same buffer, which is then the optimizer's gradient: no second copy.
Stage 2 reduce-scatters every micro-step as each bucket completes, adds the result into a
chunk-sized gradient per bucket, and frees the bucket buffer: at most `max_in_flight` buckets
exist at once, so no rank ever holds a full gradient. Buckets are reduced strictly in layout
order on every rank (a different order across ranks would mismatch the collectives).
With gradient_compression an `exchange` replaces the fp32 reduce-scatter: each bucket's chunks
go compressed to their owners, which decode the mean in full precision, synchronously, with
this rank's error buffer for that bucket ([Note: compressed all-reduce]).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from deepspeed_ext.accelerator import get_accelerator, strict
from deepspeed_ext.comm import (
    MEAN,
    AxisGroup,
    GradAverage,
    in_dtype,
    reduce_scatter_bucket,
)

from .backward_end import EndOfBackward
from .sharded_group import ShardedGroup


class ShardedReducer:
    def __init__(
        self,
        groups: list[ShardedGroup],
        accum_dtype: torch.dtype,
        reduce_every_micro_step: bool,
        group: AxisGroup,
        is_boundary: Callable[[], bool] = lambda: True,
        max_in_flight: int = 2,
        averaging: GradAverage = MEAN,
        host_grads: bool = False,
        exchange: Any = None,
        overlap: bool = True,
        scatter: Callable[..., Any] = reduce_scatter_bucket,
        comm_dtype: torch.dtype | None = None,
        flat_scatter: Callable[..., Any] | None = None,
    ) -> None:
        # the data-parallel group: it sets the scaling of every bucket; each bucket reduces
        # over its own group's axis (a spread expert's: its expert-data group)
        self.dp = group
        self.comm_dtype = comm_dtype  # [Note: communication dtype]; None: accum_dtype
        self.exchange = exchange
        # [Note: ZeRO communication keys]: overlap_comm false waits for each bucket's
        # reduction before the backward goes on; reduce_scatter false all-reduces buckets
        self.overlap = overlap
        self.scatter = scatter
        # spread experts' groups reduce over their expert-data group, by a plain collective
        # ([Note: ZeRO with spread experts]), scaled as the data-parallel ones
        self.flat_scatter = flat_scatter or scatter
        self.before, self.after = averaging.factors(group.size)
        self.is_boundary = is_boundary  # for a backward the engine did not begin
        self.begun = False  # begin() ran for the backward under way
        self.end = EndOfBackward(self.finish)  # [Note: end of backward]
        self.groups = groups
        self.accum_dtype = accum_dtype
        self.every_micro = reduce_every_micro_step
        self.max_in_flight = max_in_flight
        # global bucket order: (group, bucket)
        self.order = [
            (g, b) for g, grp in enumerate(groups) for b in range(len(grp.layout.buckets))
        ]
        self.index = {gb: i for i, gb in enumerate(self.order)}
        self.members = [0] * len(self.order)
        self.where: dict[int, tuple[int, int]] = {}
        for g, grp in enumerate(groups):
            for p in grp.params:
                b = grp.slot_of[id(p)].bucket
                self.members[self.index[(g, b)]] += 1
                self.where[id(p)] = (g, b)
        self.buffers: dict[int, torch.Tensor] = {}
        self.seen: set[int] = set()  # params that got a gradient since the last zero()
        for g, grp in enumerate(groups):
            grp.grads = []
            for b, m in enumerate(grp.masters):
                # Offloaded, the reduced gradient goes to the host even where the host is the
                # device (CPU runs take the GPU's path: [Note: device-strict mode]).
                if not self.every_micro and not host_grads and m.device == grp.flat.device:
                    i = self.index[(g, b)]
                    self.buffers[i] = self._new_buffer(i)
                    grp.grads.append(self._own(self.buffers[i], grp))
                else:  # stage 2, or offloaded: a chunk-sized gradient where the master lives
                    # pinned when offloaded from a GPU, so the copy to the host is asynchronous
                    pin = m.device.type == "cpu" and grp.flat.device.type != "cpu"
                    gb = torch.zeros(m.numel(), dtype=accum_dtype, device=m.device, pin_memory=pin)
                    grp.grads.append(strict.mark_host(gb) if host_grads else gb)
        if not self.every_micro:  # stage 1 with offload: full buffers too
            for i in range(len(self.order)):
                if i not in self.buffers:
                    self.buffers[i] = self._new_buffer(i)
        self.reduce_now = False
        self._pending: list[int] = []
        self._next = len(self.order)
        # (work, reduced chunk, bucket buffer, bucket index); work None: already the mean
        self._inflight: deque[tuple[Any, torch.Tensor, torch.Tensor, int]] = deque()
        self._copies: Any = None  # an event after the last async copy to the host
        self._copy_stream: Any = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook) for grp in groups for p in grp.params
        ]

    def _new_buffer(self, i: int) -> torch.Tensor:
        g, b = self.order[i]
        grp = self.groups[g]
        return torch.zeros(
            grp.layout.buckets[b].numel, dtype=self.accum_dtype, device=grp.flat.device
        )

    @staticmethod
    def _own(buf: torch.Tensor, grp: ShardedGroup) -> torch.Tensor:
        c = buf.numel() // grp.world
        return buf[grp.rank * c : (grp.rank + 1) * c]

    def _view(self, buf: torch.Tensor, grp: ShardedGroup, p: torch.Tensor) -> torch.Tensor:
        s = grp.slot_of[id(p)]
        return buf[s.offset : s.offset + s.numel].view(s.shape)

    def _hook(self, p: torch.Tensor) -> None:
        g, b = self.where[id(p)]
        i = self.index[(g, b)]
        if not self.begun:  # a plain loss.backward(): the engine's boundary decides, and
            self.begin(self.is_boundary())  # autograd's end of pass finishes it
            self.end.arm()
        if i not in self.buffers:
            self.buffers[i] = self._new_buffer(i)
        assert p.grad is not None
        self.seen.add(id(p))
        self._view(self.buffers[i], self.groups[g], p).add_(p.grad)
        p.grad = None
        if self.reduce_now:
            self._pending[i] -= 1
            self._launch_ready()

    def begin(self, boundary: bool) -> None:
        self.begun = True
        self.reduce_now = self.every_micro or boundary
        if self.reduce_now:
            self._pending = list(self.members)
            self._next = 0

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._pending[self._next] <= 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        g, _ = self.order[i]
        grp = self.groups[g]
        buf = self.buffers.get(i)
        if buf is None:  # no param of this bucket got a gradient in this backward
            buf = self._new_buffer(i)
        # In place: the result lands in this rank's own chunk of the bucket buffer, so no
        # per-step output buffers are allocated (glibc keeps such churn resident).
        out = self._own(buf, grp)
        if self.exchange is not None:
            self.exchange.reduce_scatter(i, buf, out)
            work = None
        else:
            if self.before != 1:
                buf.mul_(self.before)
            own = lambda t: self._own(t, grp)  # noqa: E731 - this rank's chunk of a bucket
            scatter = self.scatter if grp.expert is None else self.flat_scatter
            work = in_dtype(buf, self.comm_dtype, lambda t: scatter(own(t), t, group=grp.axis), own)
        self._inflight.append((work, out, buf, i))
        if self.every_micro:
            self.buffers.pop(i, None)  # the in-flight entry keeps it alive until reduced
            while len(self._inflight) > self.max_in_flight:
                self._drain_one()
        if not self.overlap:
            while self._inflight:
                self._drain_one()

    def _drain_one(self) -> None:
        work, out, buf, i = self._inflight.popleft()
        g, b = self.order[i]
        grp = self.groups[g]
        if work is not None:
            work.wait()
            out.mul_(self.after)  # the average over ranks, as DDP (or the sum)
        dst = grp.grads[b]
        if self.every_micro:  # offloaded: a blocking copy, as add_ reads it on the host now
            dst.add_(out if out.device == dst.device else out.to(dst.device))
        elif dst.data_ptr() != out.data_ptr():  # stage 1 offloaded: to the host
            self._copy_to_host(dst, out)
        # stage 1: the rest of the bucket buffer is stale now; zero() clears it after the step

    def _copy_to_host(self, dst: torch.Tensor, out: torch.Tensor) -> None:
        """Asynchronously, on a copy stream (where the accelerator has streams), so the next
        bucket's reduction overlaps it; finish() waits on the event before the step reads.
        The source chunk stays untouched until zero() after that step."""
        acc = get_accelerator()
        if self._copies is None:
            self._copy_stream, self._copies = acc.Stream(), acc.Event()
        self._copy_stream.wait_stream(acc.current_stream())  # the reduced chunk is ready
        with acc.stream(self._copy_stream):
            dst.copy_(out, non_blocking=True)
        self._copies.record(self._copy_stream)

    def finish(self) -> None:
        self.begun = False
        if not self.reduce_now:
            return
        while self._next < len(self.order):
            self._launch(self._next)
            self._next += 1
        while self._inflight:
            self._drain_one()
        if self._copies is not None:
            self._copies.synchronize()
        self.reduce_now = False

    def zero(self) -> None:
        self.seen.clear()
        for grp in self.groups:
            for g in grp.grads:
                g.zero_()
        if not self.every_micro:
            for buf in self.buffers.values():
                buf.zero_()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
