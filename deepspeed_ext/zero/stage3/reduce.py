"""Stage-3 gradients into their owners' shards.

[Note: stage-3 gradient reduction]
Each trainable parameter's post-accumulate-grad hook hands its fresh full .grad here, which
is copied at once into the bucket being filled and then freed: no full-size gradient lives
past its own hook. A bucket is a [W, C] buffer (C: its share of reduce_bucket_size, below,
over W), row r holding every bucketed parameter's shard r, in the order gradients become
ready (the same on every rank: the same graph). When the next gradient would not fit, the
bucket's rows are closed up to [W, used] and one reduce-scatter leaves this rank's row,
summed over ranks, which is added (averaged) into each parameter's shard-sized gradient
partition. Buckets come from a pool of at most `max_in_flight` + 1 buffers, reused through
the backward pass and freed at its end; reduce_bucket_size is what they hold together (each
1 / (max_in_flight + 1) of it), so overlapping a reduction with the next bucket's filling
costs no memory over overlap_comm false: at 4 ranks, two 12.8 MB buckets were 13 MB of a 277
MB peak (on gloo each reduction in flight adds its receive scratch, [Note: reduce-scatter by
exchange]); a parameter whose shards alone exceed C gets a buffer of its own for that one
reduction (its gradient itself, when that divides into W equal shards). Whatever is pending
when backward ends is flushed by end_backward().

A gradient partition is made by the first reduction that reaches it and dropped when the
step's gradients are zeroed, so it does not sit beside the next forward's activations: in
backward the partitions grow as the activations are freed, and the peak is near the larger
of the two instead of their sum. A partition nothing reached reads as zeros (part_of makes
it). Pinned host partitions (optimizer offload from a GPU) stay allocated: pinning is slow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed_ext.comm import MEAN, AxisGroup, GradAverage, reduce_scatter_bucket


@dataclass
class _Bucket:
    flat: torch.Tensor  # W * cap elements
    cap: int  # elements per row
    pooled: bool  # back to the pool when its reduction is done
    used: int = 0
    params: list[Any] = field(default_factory=list)

    def rows(self, world: int) -> torch.Tensor:
        return self.flat.view(world, self.cap)

    def close_up(self, world: int) -> torch.Tensor:
        """The filled columns as one contiguous [W, used] block at the buffer's start (the
        collective wants each rank's chunk contiguous)."""
        if self.used == self.cap:  # full: every row is in its place already
            return self.flat
        rows = self.rows(world)
        for r in range(1, world):
            src = rows[r, : self.used]
            dst = self.flat[r * self.used : (r + 1) * self.used]
            # rows only move down (row r+1's source lies past row r's new place); a row
            # overlaps its own new place when r * cap < (r + 1) * used
            dst.copy_(src.clone() if r * self.cap < (r + 1) * self.used else src)
        return self.flat[: world * self.used]


def fill_shards(cols: torch.Tensor, flat: torch.Tensor) -> None:
    """cols ([W, S] view) <- flat (N <= W*S elements) cut into shards; the padding past N
    is zeroed (a reused buffer holds the last step's values there)."""
    n, s = flat.numel(), cols.shape[1]
    k = n // s
    if k:
        cols[:k].copy_(flat[: k * s].view(k, s))
    if k < cols.shape[0]:
        rest = n - k * s
        cols[k, :rest].copy_(flat[k * s :])
        cols[k, rest:].zero_()
        cols[k + 1 :].zero_()


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
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        self.group = group  # data-parallel
        self.scatter = scatter  # [Note: ZeRO communication keys]
        self.world = group.size
        self.before, self.after = averaging.factors(self.world)
        self.accum_dtype = accum_dtype
        # buckets are built in the dtype they are reduced in ([Note: communication dtype])
        self.bucket_dtype = comm_dtype or accum_dtype
        self.bucket_numel = max(1, bucket_numel)
        self.max_in_flight = max_in_flight
        self.grad_device = grad_device
        pin = grad_device.type == "cpu" and any(p.ds_device.type != "cpu" for p in params)
        self.resident = pin
        # part[id(p)]: [S] this rank's shard of p's gradient, accumulated over micro-steps;
        # absent (zero) until a reduction reaches it, unless resident
        self.part: dict[int, torch.Tensor] = {}
        if pin:
            for p in params:
                self.part_of(p)
        # elements per row of a bucket; never more than every shard (the default 5e8 bucket)
        per_buffer = -(-self.bucket_numel // (max_in_flight + 1))  # pooled buffers share it
        self.cap = min(-(-per_buffer // self.world), sum(p.ds_shard_numel for p in params))
        self.pool: list[torch.Tensor] = []  # free bucket buffers, dropped when backward ends
        self.made = 0  # pooled buffers made in this backward (at most max_in_flight + 1)
        self.current: _Bucket | None = None
        self.in_flight: deque[tuple[Any, torch.Tensor, _Bucket]] = deque()
        # called with a bucket's parameters once their partitions hold its reduction
        self.on_reduced: Callable[[list[Any]], None] | None = None

    def add(self, p: Any, grad: torch.Tensor) -> None:
        """Copy `grad` (p's full gradient) into the bucket; the caller then drops it."""
        s = p.ds_shard_numel
        if s > self.cap:  # too big for a pooled bucket: a buffer of its own
            self._launch()
            if grad.numel() == self.world * s and grad.dtype == self.bucket_dtype:
                # already laid out as [W, S]: the gradient is its own bucket (no copy)
                bucket = _Bucket(grad.reshape(-1), s, pooled=False, used=s, params=[p])
            else:
                own = torch.empty(self.world * s, dtype=self.bucket_dtype, device=grad.device)
                bucket = _Bucket(own, s, pooled=False)
                self._put(bucket, p, grad)
            self._launch_bucket(bucket)
            return
        if self.current is not None and self.current.used + s > self.cap:
            self._launch()
        if self.current is None:
            self.current = _Bucket(self._take(grad.device), self.cap, pooled=True)
        self._put(self.current, p, grad)

    def _put(self, bucket: _Bucket, p: Any, grad: torch.Tensor) -> None:
        s = p.ds_shard_numel
        fill_shards(bucket.rows(self.world)[:, bucket.used : bucket.used + s], grad.reshape(-1))
        bucket.used += s
        bucket.params.append(p)

    def _take(self, device: torch.device) -> torch.Tensor:
        """A free pooled buffer; waits for the oldest reduction when all are in use."""
        while not self.pool and self.made > self.max_in_flight:
            self._complete()
        if self.pool:
            return self.pool.pop()
        self.made += 1
        return torch.empty(self.world * self.cap, dtype=self.bucket_dtype, device=device)

    def _launch(self) -> None:
        bucket, self.current = self.current, None
        if bucket is not None and bucket.used:
            self._launch_bucket(bucket)
        elif bucket is not None:
            self.pool.append(bucket.flat)

    def _launch_bucket(self, bucket: _Bucket) -> None:
        flat = bucket.close_up(self.world)
        if self.before != 1:
            flat.mul_(self.before)
        # this rank's row of the bucket: the reduce-scatter runs in place (no output buffer)
        out = flat.view(self.world, bucket.used)[self.group.rank]
        work = self.scatter(out, flat, group=self.group)
        self.in_flight.append((work, out, bucket))
        while len(self.in_flight) > self.max_in_flight:
            self._complete()

    def part_of(self, p: Any) -> torch.Tensor:
        """p's gradient partition, made (zeros) if no reduction has reached it yet."""
        part = self.part.get(id(p))
        if part is None:
            part = torch.zeros(
                p.ds_shard_numel,
                dtype=self.accum_dtype,
                device=self.grad_device,
                pin_memory=self.resident,
            )
            self.part[id(p)] = part
        return part

    def _complete(self) -> None:
        work, out, bucket = self.in_flight.popleft()
        work.wait()
        off = 0
        for p in bucket.params:
            s = p.ds_shard_numel
            mine = out[off : off + s]
            part = self.part.get(id(p))
            if part is None:  # the first reduction makes the partition (no zeros first)
                part = mine.to(self.grad_device, self.accum_dtype, copy=True)
                if self.after != 1:
                    part.mul_(self.after)
                self.part[id(p)] = part
            else:
                part.add_(mine.to(part.device), alpha=self.after)
            off += s
        if self.on_reduced is not None:
            self.on_reduced(list(bucket.params))
        if bucket.pooled:
            bucket.used, bucket.params = 0, []
            self.pool.append(bucket.flat)

    def flush(self) -> None:
        """End of backward: reduce what is pending, then free the pool (kept, it would sit
        beside the next forward's activations)."""
        self._launch()
        while self.in_flight:
            self._complete()
        self.pool.clear()
        self.made = 0

    def grads(self) -> list[torch.Tensor]:
        """The partitions made so far (those not made are zeros)."""
        return list(self.part.values())

    def zero(self) -> None:
        if self.resident:
            for g in self.part.values():
                g.zero_()
        else:
            self.part.clear()
