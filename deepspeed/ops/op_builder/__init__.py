"""Upstream's `deepspeed.ops.op_builder`: the builder classes, re-exported."""

from deepspeed_ext.op_builder import (
    ALL_OPS,
    AsyncIOBuilder,
    Compat,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    CPUOpBuilder,
    CUDAOpBuilder,
    OpBuilder,
    OpBuildError,
)
from deepspeed_ext.op_builder.fused_adam import FusedAdamBuilder
from deepspeed_ext.op_builder.fused_lamb import FusedLambBuilder

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CPUOpBuilder",
    "CUDAOpBuilder",
    "Compat",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "OpBuildError",
    "OpBuilder",
]
