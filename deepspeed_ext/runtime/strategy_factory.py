"""Which gradient strategy a config asks for ([Note: gradient strategy]), built from one
context object."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.zero.protocol import GradientStrategy, StrategyContext

from .dp_strategy import DataParallelStrategy

# DDP's default bucket: big enough to amortize a collective, small enough to overlap backward.
DEFAULT_BUCKET_BYTES = 25 * 2**20
MIN_PARTITIONED_BUCKET_NUMEL = 1 << 20


def reduce_bucket_numel(
    zero: Any, stage: int, params: list[torch.nn.Parameter], elem_size: int
) -> int:
    """Elements per gradient reduction bucket: the user's reduce_bucket_size, else DDP's
    25 MB for stages 0-1, whose full-size gradient buffers live all step anyway. At stages
    2-3 a bucket exists only while it is filled and reduced (up to 3 at once), so that is
    the transient memory of backward: there the default is about the largest parameter (a
    parameter is never split across buckets; at least 1M elements, at most 25 MB), as FSDP
    reduces one module at a time. [Note: ZeRO gradient reduction]"""
    if zero.reduce_bucket_size is not None:
        return int(zero.reduce_bucket_size)
    cap = DEFAULT_BUCKET_BYTES // elem_size
    if stage < 2:
        return cap
    largest = max((getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad), default=0)
    return min(cap, max(largest, MIN_PARTITIONED_BUCKET_NUMEL))


def make_strategy(ctx: StrategyContext, stage: int) -> GradientStrategy:
    if stage < 3 and any(hasattr(p, "ds_id") for p in ctx.module.parameters()):
        raise ValueError(
            f"the model was built under deepspeed.zero.Init (its parameters are partitioned)"
            f" but zero_optimization.stage is {stage}: set zero_optimization.stage to 3, "
            "or build the model without zero.Init"
        )
    # the config checks refuse these before spawn; a stage left "auto" is only known here
    if stage and ctx.hierarchy is not None and not ctx.zero.reduce_scatter:
        raise ValueError(
            "communication.topology 'hierarchical' runs ZeRO's reduce-scatter in two steps; "
            "zero_optimization.reduce_scatter is false: set it to true or the topology to 'flat'"
        )
    if stage == 3 and ctx.grad_exchange is not None:
        raise ValueError(
            "gradient_compression runs with zero_optimization.stage 0, 1 or 2; the stage "
            "resolved to 3: set it to 2 or remove gradient_compression"
        )
    if stage == 0:
        return DataParallelStrategy(ctx)
    if stage == 3:
        from deepspeed_ext.zero.stage3 import Stage3Options, Stage3Strategy

        return Stage3Strategy(ctx, Stage3Options(ctx.zero, ctx.bucket_numel, ctx.aio))
    from deepspeed_ext.zero import ZeroStrategy

    return ZeroStrategy(ctx, stage)
