"""Top-k gating with expert capacity (GShard / Switch routing), as upstream's sharded_moe.

[Note: MoE routes]
Gating yields, for each of a token's k routes, the expert (-1 where capacity dropped it), its
slot in that expert's buffer, and its combine weight. Dispatch and combine then move only the
s x k chosen rows (a scatter into an [experts x capacity] buffer, and a gather back), instead
of the dense [s, e, c] one-hot einsums; `dense_weights` rebuilds those for upstream's public
top1gating / top2gating / topkgating, which return them.

Capacity is ceil(tokens / experts * capacity_factor * k), at least min_capacity. Without
drop_tokens it is the busiest expert's load, the largest over the expert-parallel group (every
rank's buffers must have one shape for the all-to-all). With drop_tokens and ep_size > 1 each
rank's capacity is also the largest over the group, so ranks with other token counts (ragged
sequences) do not hang the all-to-all; with equal counts it is the same number.

The auxiliary (load-balancing) loss is upstream's: for top-1 sum(me * ce) * E; for top-2
mean(me * ce) * E^2; for top-k mean(me * ce) * E^2 / k; me the mean gate per expert, ce the
fraction of tokens whose first choice (all k choices for top-k) it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deepspeed_ext.comm.expert_groups import expert_axis, max_over

Reduce = Callable[[int], int]  # the capacity agreed over the expert-parallel group
Dense = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_EPS = torch.finfo(torch.float32).eps  # a floor for the kept gates' sum (gates are fp32)


@dataclass
class Routes:
    l_aux: torch.Tensor
    capacity: int
    num_experts: int
    experts: torch.Tensor  # [k, s] int64: the expert of each route; -1: dropped
    slots: torch.Tensor  # [k, s] int64: position in that expert's buffer (0 where dropped)
    weights: torch.Tensor  # [k, s] float32: combine weight (0 where dropped)
    exp_counts: torch.Tensor  # [e] int64: tokens choosing each expert, before capacity


def agreement(ep_group: Any) -> Reduce:
    """How a capacity is agreed over what a gate is given: this package's ExpertGroups, a
    torch process group (upstream's), or None (every expert on this rank: as it is)."""
    axis = expert_axis(ep_group)
    return int if axis is None else (lambda c: max_over(c, axis))


def capacity_of(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(num_tokens / num_experts * factor), int(min_capacity))


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> torch.Tensor:
    u = torch.rand(shape, device=device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(
    x: torch.Tensor, device: torch.device, epsilon: float = 1e-2
) -> torch.Tensor:
    """x times a uniform factor in [1 - epsilon, 1 + epsilon] (the Switch Transformer's)."""
    if epsilon == 0:
        return x
    return x * torch.empty_like(x, device=device).uniform_(1.0 - epsilon, 1.0 + epsilon)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """[s, e] 0/1 -> each chosen token's arrival order at its expert (cumsum - 1)."""
    return torch.cumsum(mask, dim=0) - 1


def _keep_first(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    return mask * (_positions(mask) < capacity)


def _keep_top(mask: torch.Tensor, score: torch.Tensor, capacity: int) -> torch.Tensor:
    """Per expert, the `capacity` chosen tokens with the highest score."""
    k = min(capacity, mask.shape[0])
    top = torch.topk(score * mask, k=k, dim=0).indices
    return mask * torch.zeros_like(mask).scatter_(0, top, 1)


def _route(
    mask: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, choice: torch.Tensor
):
    """One route per token from its [s, e] kept-mask, positions and weights at `choice`."""
    col = choice.unsqueeze(1)
    kept = mask.gather(1, col).squeeze(1) > 0
    experts = torch.where(kept, choice, torch.full_like(choice, -1))
    slots = torch.where(kept, positions.gather(1, col).squeeze(1), torch.zeros_like(choice))
    return experts, slots, weights.gather(1, col).squeeze(1) * kept


def _capacity(
    drop_tokens: bool,
    s: int,
    e: int,
    factor: float,
    min_capacity: int,
    exp_counts: torch.Tensor,
    agree: Reduce,
) -> int:
    """By the factor, or without drop_tokens the busiest expert's load; agreed over the
    expert-parallel group either way ([Note: MoE routes])."""
    if drop_tokens:
        return agree(capacity_of(s, e, factor, min_capacity))
    return max(agree(int(exp_counts.max())), 1)


def _used(mask: torch.Tensor, used_token: torch.Tensor | None) -> torch.Tensor:
    return mask if used_token is None else mask * used_token.reshape(-1, 1).to(mask.dtype)


def _stacked(routes: list[Any]) -> Any:
    """Per route (experts, slots, weights) -> each stacked to [k, s]."""
    return (torch.stack(t) for t in zip(*routes))


def top1(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None,
    noisy_gate_policy: str | None,
    drop_tokens: bool,
    use_rts: bool,
    agree: Reduce,
) -> Routes:
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    noisy = noisy_gate_policy == "RSample"
    pick = logits + gumbel_rsample(logits.shape, logits.device) if noisy else gates
    choice = torch.argmax(pick, dim=1)
    mask = _used(F.one_hot(choice, e), used_token)
    exp_counts = mask.sum(0).detach()
    l_aux = torch.sum(gates.mean(0) * mask.float().mean(0)) * e
    capacity = _capacity(drop_tokens, s, e, capacity_factor, min_capacity, exp_counts, agree)
    if drop_tokens and use_rts:  # random token selection: who stays is random
        mask = _keep_top(mask, torch.rand(mask.shape, device=mask.device), capacity)
    elif drop_tokens:
        mask = _keep_first(mask, capacity)
    experts, slots, weights = _route(mask, _positions(mask), gates, choice)
    return Routes(l_aux, capacity, e, experts[None], slots[None], weights[None], exp_counts)


def top2(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None,
    drop_tokens: bool,
    second_sampling: bool,
    agree: Reduce,
) -> Routes:
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, e)
    noisy = logits + gumbel_rsample(logits.shape, logits.device) if second_sampling else logits
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask1, mask2 = _used(mask1, used_token), _used(F.one_hot(second, e), used_token)
    pos1 = _positions(mask1)
    pos2 = _positions(mask2) + mask1.sum(0, keepdim=True)  # second choices queue behind firsts
    l_aux = torch.mean(gates.mean(0) * mask1.float().mean(0)) * e * e
    exp_counts = (mask1 + mask2).sum(0).detach()
    capacity = _capacity(drop_tokens, s, e, capacity_factor * 2, min_capacity, exp_counts, agree)
    if drop_tokens:
        mask1 = mask1 * (pos1 < capacity)
        mask2 = mask2 * (pos2 < capacity)
    denom = torch.clamp((gates * mask1).sum(1) + (gates * mask2).sum(1), min=_EPS)
    norm = gates / denom.unsqueeze(1)
    pairs = ((mask1, pos1, first), (mask2, pos2, second))
    experts, slots, weights = _stacked([_route(m, p, norm, c) for m, p, c in pairs])
    return Routes(l_aux, capacity, e, experts, slots, weights, exp_counts)


def topk(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None,
    drop_tokens: bool,
    drop_policy: str,
    agree: Reduce,
) -> Routes:
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    top_idx = torch.topk(gates, k=k, dim=1).indices
    mask = _used(torch.zeros_like(gates, dtype=torch.int64).scatter_(1, top_idx, 1), used_token)
    exp_counts = mask.sum(0).detach()
    l_aux = torch.mean(gates.mean(0) * mask.float().mean(0)) * e * e / k
    capacity = _capacity(drop_tokens, s, e, capacity_factor * k, min_capacity, exp_counts, agree)
    if drop_tokens and drop_policy == "probs":  # keep each expert's most confident tokens
        mask = _keep_top(mask, gates, capacity)
    elif drop_tokens:  # "position": the first to arrive
        mask = _keep_first(mask, capacity)
    positions = _positions(mask)
    masked = gates * mask
    norm = masked / torch.clamp(masked.sum(1, keepdim=True), min=_EPS)
    routes = [_route(mask, positions, norm, top_idx[:, j]) for j in range(k)]
    experts, slots, weights = _stacked(routes)
    return Routes(l_aux, capacity, e, experts, slots, weights, exp_counts)


def flat_slots(routes: Routes) -> torch.Tensor:
    """[k, s] rows of the flat [experts * capacity] buffer; dropped routes point one past it."""
    scratch = routes.num_experts * routes.capacity
    flat = routes.experts.clamp(min=0) * routes.capacity + routes.slots
    return torch.where(routes.experts >= 0, flat, torch.full_like(flat, scratch))


def dispatch(x: torch.Tensor, routes: Routes) -> torch.Tensor:
    """[s, m] tokens -> [e, c, m] expert buffers (empty slots zero)."""
    e, c = routes.num_experts, routes.capacity
    slots = flat_slots(routes)
    k = slots.shape[0]
    buf = x.new_zeros(e * c + 1, x.shape[1]).index_add(0, slots.reshape(-1), x.repeat(k, 1))
    return buf[: e * c].view(e, c, x.shape[1])


def combine(expert_out: torch.Tensor, routes: Routes) -> torch.Tensor:
    """[e, c, m] expert outputs -> [s, m]: each token's routes, weighted and summed."""
    m = expert_out.shape[-1]
    padded = torch.cat([expert_out.reshape(-1, m), expert_out.new_zeros(1, m)])
    slots = flat_slots(routes)
    rows = padded.index_select(0, slots.reshape(-1)).view(*slots.shape, m)
    return (rows * routes.weights.to(expert_out.dtype).unsqueeze(-1)).sum(0)


def dense_weights(routes: Routes) -> tuple[torch.Tensor, torch.Tensor]:
    """(combine_weights [s, e, c] float32, dispatch_mask [s, e, c] bool), upstream's form."""
    k, s = routes.experts.shape
    e, c = routes.num_experts, routes.capacity
    weights = routes.weights.new_zeros(s, e * c + 1)
    weights = weights.scatter_add(1, flat_slots(routes).t(), routes.weights.t())
    combine_weights = weights[:, : e * c].view(s, e, c)
    return combine_weights, combine_weights.bool()


def dense_form(routes: Routes) -> Dense:
    """Upstream's gating return: (l_aux, combine_weights, dispatch_mask, exp_counts)."""
    combine_weights, dispatch_mask = dense_weights(routes)
    return routes.l_aux, combine_weights, dispatch_mask, routes.exp_counts
