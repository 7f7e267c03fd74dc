"""Upstream's gating functions by their names and signatures, returning the dense
(l_aux, combine_weights [s, e, c], dispatch_mask [s, e, c], exp_counts) of [Note: MoE routes].
`ep_group` is an ExpertGroups, a torch process group (upstream's), or None: the capacity is
agreed over it."""

from __future__ import annotations

from typing import Any

import torch

from . import gating


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: Any = None,
    use_tutel: bool = False,
) -> gating.Dense:
    r = gating.top1(
        logits,
        capacity_factor,
        min_capacity,
        used_token,
        noisy_gate_policy,
        drop_tokens,
        use_rts,
        gating.agreement(ep_group),
    )
    return gating.dense_form(r)


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    top2_2nd_expert_sampling: bool = True,
) -> gating.Dense:
    r = gating.top2(
        logits,
        capacity_factor,
        min_capacity,
        None,
        drop_tokens,
        top2_2nd_expert_sampling,
        gating.agreement(ep_group),
    )
    return gating.dense_form(r)


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    drop_policy: str = "probs",
) -> gating.Dense:
    r = gating.topk(
        logits,
        k,
        capacity_factor,
        min_capacity,
        None,
        drop_tokens,
        drop_policy,
        gating.agreement(ep_group),
    )
    return gating.dense_form(r)
