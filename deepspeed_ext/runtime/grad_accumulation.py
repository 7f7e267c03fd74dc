"""Where gradients go after backward: flat accumulation buckets, reduced at the boundary.

[Note: gradient path]
A post-accumulate-grad hook on each trainable param adds its fresh .grad into that param's
view of a flat bucket (in the accumulation dtype: fp32 for 16-bit models by default, where
upstream's default accumulates in the model's dtype; data_types.grad_accum_dtype picks
another) and drops .grad, so a micro-step holds one copy of the gradients.
On the micro-step that ends an accumulation window the hook also marks the param ready,
which launches the bucket's all-reduce while backward continues (comm.GradBuckets). After
wait(), the buckets hold the averaged sum over ranks and micro-steps; grads() exposes them
as per-param views for the optimizer, clipping and get_global_grad_norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed_ext.comm import MEAN, GradAverage, GradBuckets
from deepspeed_ext.zero.backward_end import EndOfBackward


class GradAccumulator:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        accum_dtype: torch.dtype,
        bucket_numel: int,
        group: Any = None,
        is_boundary: Callable[[], bool] = lambda: True,
        averaging: GradAverage = MEAN,
        exchange: Callable[[list[torch.Tensor]], None] | None = None,
        hierarchy: Any = None,
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.buckets = GradBuckets(
            self.params,
            bucket_numel,
            accum_dtype,
            group=group,
            averaging=averaging,
            hierarchy=hierarchy,
            comm_dtype=comm_dtype,
        )
        self.reduce_now = False  # set by the engine before a boundary micro-step's backward
        self.begun = False  # begin() ran for the backward under way
        self.is_boundary = is_boundary  # for a backward the engine did not begin
        self.sync_enabled = True  # False inside engine.no_sync()
        # True: never reduce, each rank keeps its own gradients ([Note: 1-bit Adam])
        self.local = False
        # set: the boundary's reduction is this call on every param's gradient view (a
        # compressed mean, gradient_compression) instead of bucket all-reduces during backward
        self.exchange = exchange
        self.end = EndOfBackward(self.finish)  # [Note: end of backward]
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def _hook(self, p: torch.Tensor) -> None:
        assert p.grad is not None
        self.buckets.grad_view(p).add_(p.grad)
        p.grad = None
        if not self.begun:  # a plain loss.backward(): the engine's boundary decides, and
            self.begin(self.is_boundary())  # autograd's end of pass finishes it
            self.end.arm()
        if self.reduce_now and self.exchange is None:
            self.buckets.mark_ready(p)

    def begin(self, boundary: bool) -> None:
        """Called before a micro-step's backward."""
        self.begun = True
        self.reduce_now = boundary and self.sync_enabled and not self.local
        if self.reduce_now and self.exchange is None:
            self.buckets.start()

    def finish(self) -> None:
        """Called after a micro-step's backward: complete a boundary's all-reduce."""
        self.begun = False
        if self.reduce_now:
            if self.exchange is not None:  # per parameter: each keeps scales of its own
                self.exchange([self.buckets.grad_view(p) for p in self.params])
            else:
                self.buckets.wait()
            self.reduce_now = False

    def grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(p, self.buckets.grad_view(p)) for p in self.params]

    def flat(self) -> list[torch.Tensor]:
        return self.buckets.buffers

    def zero(self) -> None:
        self.buckets.zero()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
