"""Which gradient strategy a config asks for ([Note: gradient strategy]), built from one
context object."""

from __future__ import annotations

from deepspeed_ext.zero.protocol import GradientStrategy, StrategyContext

from .dp_strategy import DataParallelStrategy


def make_strategy(ctx: StrategyContext, stage: int) -> GradientStrategy:
    if stage < 3 and any(hasattr(p, "ds_id") for p in ctx.module.parameters()):
        raise ValueError(
            f"the model was built under deepspeed.zero.Init (its parameters are partitioned)"
            f" but zero_optimization.stage is {stage}: set zero_optimization.stage to 3, "
            "or build the model without zero.Init"
        )
    if stage == 0:
        return DataParallelStrategy(ctx)
    if stage == 3:
        from deepspeed_ext.zero.stage3 import Stage3Options, Stage3Strategy

        return Stage3Strategy(ctx, Stage3Options(ctx.zero, ctx.bucket_numel, ctx.aio))
    from deepspeed_ext.zero import ZeroStrategy

    return ZeroStrategy(ctx, stage)
