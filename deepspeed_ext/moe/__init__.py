"""Mixture of experts: upstream's deepspeed.moe (MoE layers, top-k gating, expert groups)."""

from .gating import gumbel_rsample, multiplicative_jitter
from .layer import Experts, MoE, MOELayer, TopKGate
from .upstream_gating import top1gating, top2gating, topkgating

__all__ = [
    "Experts",
    "MoE",
    "MOELayer",
    "TopKGate",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]
