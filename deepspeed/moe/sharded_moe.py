"""`deepspeed.moe.sharded_moe`: upstream's import path for the gate and the MoE layer core."""

from deepspeed_ext.moe import (
    MOELayer,
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)

__all__ = [
    "MOELayer",
    "TopKGate",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]
