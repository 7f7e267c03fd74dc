"""Expert-parallel and expert-data-parallel groups for MoE layers, and the token all-to-all.

[Note: expert groups]
An MoE layer with ep_size E spreads its experts over E ranks of one data-parallel group: the
expert-parallel group, which exchanges tokens by all-to-all. The ranks that hold the same
experts form the expert-data-parallel group, over which those experts' gradients are summed.
Each data-parallel group of the layout is cut alike. By default (upstream's E + D order) the
expert-parallel groups are consecutive runs of E data ranks and the expert-data-parallel
groups take one rank from each run; with use_data_before_expert_parallelism (D + E) the
expert-data-parallel groups are consecutive runs of (data size / E) ranks and the
expert-parallel groups take one rank from each.
Groups are made once per E and named "ep_size_E", as upstream names them; every rank makes
every group, in one order. An expert parameter carries `allreduce = False` and its layer's
`group_name` (upstream's marks), which is how the gradient buckets find its groups.

Scaling: an expert's gradient on one rank already holds every token of its expert-parallel
group (the all-to-all's backward brings them home), so summing over the expert-data group
covers the whole data-parallel batch once, and the mean divides by the data-parallel size,
as a dense parameter's does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .checked import dist
from .layout import AxisGroup, ParallelLayout, _groups_along, axis_of, current
from .sharded import collective_device


@dataclass(frozen=True)
class ExpertGroups:
    name: str
    ep_size: int
    expert: AxisGroup  # the expert-parallel group: tokens travel over it
    expert_data: AxisGroup  # the ranks holding the same experts: gradients are summed over it
    data_before_expert: bool = False  # which order cut them (D + E, or upstream's E + D)


T = TypeVar("T")

_made: dict[str, tuple[ParallelLayout, ExpertGroups]] = {}


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


def expert_rank_lists(
    data_lists: list[list[int]], ep_size: int, data_before_expert: bool = False
) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel rank lists, expert-data-parallel rank lists) for these data groups."""
    expert: list[list[int]] = []
    expert_data: list[list[int]] = []
    for ranks in data_lists:
        if len(ranks) % ep_size:
            raise ValueError(
                f"an MoE layer's ep_size {ep_size} does not divide the data-parallel size "
                f"{len(ranks)}: pick an ep_size that divides it (and num_experts), or launch "
                "a multiple of it"
            )
        # E + D: runs of ep_size ranks hold all the experts; their i-th ranks hold copies.
        # D + E: runs of copies (data size / ep_size ranks) hold the same experts, and the
        # i-th ranks of the runs together hold all of them
        width = len(ranks) // ep_size if data_before_expert else ep_size
        runs = [list(ranks[i : i + width]) for i in range(0, len(ranks), width)]
        across = [list(col) for col in zip(*runs)]
        expert += across if data_before_expert else runs
        expert_data += runs if data_before_expert else across
    return expert, expert_data


def _data_lists(layout: ParallelLayout) -> list[list[int]]:
    """Every data-parallel group's ranks (each rank knows only its own: gather them)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(layout.data.ranks)]
    mine: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(mine, tuple(layout.data.ranks))
    return [list(r) for r in sorted(set(mine))]


def ensure_expert_groups(ep_size: int, data_before_expert: bool = False) -> ExpertGroups:
    """This rank's groups for ep_size, made on first call under the current layout.
    Collective over the world when it makes them."""
    name = group_name(ep_size)
    layout = current()
    made = _made.get(name)
    if made is not None and made[0] is layout:
        if made[1].data_before_expert != data_before_expert:
            raise ValueError(
                f"the expert groups {name} were made with use_data_before_expert_parallelism="
                f"{made[1].data_before_expert}, and are asked for with {data_before_expert}: one "
                "layout holds one order; set it alike (the config's and "
                "set_deepspeed_parallelism's)"
            )
        return made[1]
    rank = dist.get_rank() if dist.is_initialized() else 0
    expert_lists, data_lists = expert_rank_lists(_data_lists(layout), ep_size, data_before_expert)

    def make(ranks: list[int]) -> Any:
        return dist.new_group(ranks) if dist.is_initialized() else None

    groups = ExpertGroups(
        name,
        ep_size,
        _groups_along(expert_lists, rank, make),
        _groups_along(data_lists, rank, make),
        data_before_expert,
    )
    _made[name] = (layout, groups)
    return groups


def expert_groups_of(p: torch.Tensor) -> ExpertGroups | None:
    """The groups of an expert parameter whose experts are spread over ranks; None for a
    dense one, or an expert layer with ep_size 1 (its experts are plain replicas)."""
    if getattr(p, "allreduce", True):
        return None
    made = _made.get(getattr(p, "group_name", ""))
    if made is None or made[0] is not current() or made[1].ep_size == 1:
        return None
    return made[1]


def expert_groups_made() -> dict[str, ExpertGroups]:
    """The groups made, by name: the latest for each (an engine made before another
    initialize keeps training with its own, which upstream's accessors answer with)."""
    return {n: g for n, (_, g) in _made.items()}


def by_expert_groups(
    pairs: Iterable[tuple[ExpertGroups | None, T]],
) -> list[tuple[ExpertGroups, list[T]]]:
    """Tensors (or anything) of spread experts, by their groups in first-seen order (None:
    dense, left out); the same order on every rank, which holds the same layers."""
    out: dict[str, tuple[ExpertGroups, list[T]]] = {}
    for groups, t in pairs:
        if groups is not None:
            out.setdefault(groups.name, (groups, []))[1].append(t)
    return list(out.values())


def expert_buffers(buckets: Any) -> list[tuple[ExpertGroups, list[torch.Tensor]]]:
    """A GradBuckets' expert buckets, by their groups (in bucket order)."""
    return by_expert_groups(zip(buckets.experts, buckets.buffers))


class _AllToAll(torch.autograd.Function):
    """Equal chunks of dim 0 to each rank of the group; the backward sends gradients home."""

    @staticmethod
    def forward(ctx: Any, axis: AxisGroup, x: torch.Tensor) -> torch.Tensor:
        ctx.axis = axis
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=axis.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.axis, grad)


def all_to_all(x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """Differentiable all-to-all over an axis (dim 0 split evenly); the identity over one."""
    if axis.size == 1:
        return x
    return _AllToAll.apply(axis, x)


def max_over(value: int, axis: AxisGroup) -> int:
    """The largest of an int over the axis (the capacity every rank of it must use)."""
    if axis.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(axis))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=axis.group)
    return int(t.item())


def expert_axis(ep_group: Any) -> AxisGroup | None:
    """The expert-parallel axis of what a gate is given: this package's ExpertGroups, or a
    torch process group as code written for upstream passes (groups._get_expert_parallel_
    group); None: no group (every expert on this rank)."""
    if ep_group is None:
        return None
    if isinstance(ep_group, ExpertGroups):
        return ep_group.expert
    return axis_of(ep_group)
