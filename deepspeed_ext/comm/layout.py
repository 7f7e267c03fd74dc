"""The parallel layout: the process groups everyone who communicates uses.

[Note: parallel layout]
A ParallelLayout is built once, in deepspeed.initialize (from a topology, a Megatron-style
mpu, or by default the whole world as one data-parallel group), and becomes the process's
current layout. Every data-parallel collective (gradient buckets, ZeRO reduce-scatters and
all-gathers, the norm and overflow reductions, the initial weight broadcast, zero.Init) runs
over `layout.data`; norms are then summed over `layout.pipe` (each stage holds other
parameters). Only the layout itself touches the world group. Each axis is an AxisGroup: the
torch process group (None means the default world group), the global ranks in group order,
and this rank's index among them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checked import dist
from .topology import ProcessTopology


@dataclass(frozen=True)
class AxisGroup:
    group: Any  # the process group; None: the default (world) group
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this process's index in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    @staticmethod
    def solo(global_rank: int) -> AxisGroup:
        """A group of one: the comm wrappers skip collectives over it (group stays None)."""
        return AxisGroup(None, (global_rank,), 0)

    def process_group(self) -> Any:
        """The torch process group, for user code (deepspeed.utils.groups). A one-rank axis
        gets a real one-rank group, made on first use by this rank alone (local
        synchronization: the other ranks need not take part)."""
        if self.size > 1 or not dist.is_initialized():
            return self.group if self.group is not None else dist.group.WORLD
        if dist.get_world_size() == 1:
            return dist.group.WORLD
        me = self.ranks[0]
        if me not in _solo_groups:
            _solo_groups[me] = dist.new_group([me], use_local_synchronization=True)
        return _solo_groups[me]


@dataclass(frozen=True)
class ParallelLayout:
    data: AxisGroup
    tensor: AxisGroup
    pipe: AxisGroup
    model: AxisGroup  # the ranks holding the other parts of this replica (pipe x tensor)
    topology: ProcessTopology | None
    source: str  # where it came from, for messages

    def describe(self) -> str:
        return (
            f"data-parallel {self.data.size} x pipeline {self.pipe.size} x tensor "
            f"{self.tensor.size} (from {self.source})"
        )


_current: ParallelLayout | None = None
_solo_groups: dict[int, Any] = {}  # global rank -> its one-rank process group


def world_layout() -> ParallelLayout:
    """Pure data parallelism over every rank (no groups created)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = AxisGroup(None, tuple(range(world)), rank)
    solo = AxisGroup.solo(rank)
    return ParallelLayout(data, solo, solo, solo, None, "the world")


def _groups_along(lists: list[list[int]], rank: int, make: Callable[[list[int]], Any]) -> AxisGroup:
    """Make a group for each rank list (every rank must make all of them, in order) and
    return this rank's."""
    mine: AxisGroup | None = None
    for ranks in lists:
        group = make(ranks) if len(ranks) > 1 else None  # one-rank axes need no group
        if rank in ranks:
            mine = AxisGroup(group, tuple(ranks), ranks.index(rank))
    assert mine is not None, f"rank {rank} is in no group of {lists}"
    return mine


def layout_from_topology(topo: ProcessTopology, source: str = "a topology") -> ParallelLayout:
    """Groups along 'data', 'pipe', 'model' (tensor) and the model-parallel group (every rank
    with this rank's data coordinate). Collective: every rank calls it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if topo.world_size() != world:
        dims = " x ".join(f"{a} {topo.get_dim(a)}" for a in topo.get_axis_names())
        raise ValueError(
            f"the parallel layout ({dims} = {topo.world_size()} ranks) does not match the "
            f"world size {world}: launch {topo.world_size()} ranks, or change the layout"
        )

    def make(ranks: list[int]) -> Any:
        return dist.new_group(ranks) if dist.is_initialized() else None

    def along(axis: str) -> AxisGroup:
        lists = topo.get_axis_comm_lists(axis) or [[r] for r in range(world)]
        return _groups_along(lists, rank, make)

    data = along("data")
    pipe = along("pipe")
    tensor = along("model")
    if "data" in topo.get_axis_names():
        model_lists = [topo.get_axis_list("data", i) for i in range(topo.get_dim("data"))]
    else:
        model_lists = [list(range(world))]
    model = _groups_along(model_lists, rank, make)
    return ParallelLayout(data, tensor, pipe, model, topo, source)


def layout_from_mpu(mpu: Any) -> ParallelLayout:
    """A Megatron-style mpu (get_data_parallel_group, get_model_parallel_*, and optionally
    get_tensor_model_parallel_* / get_pipe_parallel_*): its groups, as they are."""
    rank = dist.get_rank() if dist.is_initialized() else 0

    def axis(prefixes: tuple[str, ...], required: bool) -> AxisGroup:
        for pre in prefixes:
            get_group = getattr(mpu, f"get_{pre}_group", None)
            if get_group is None:
                continue
            group = get_group()
            if group is None:
                return AxisGroup.solo(rank)
            ranks = tuple(dist.get_process_group_ranks(group)) if dist.is_initialized() else (0,)
            if len(ranks) == 1:
                return AxisGroup.solo(rank)
            return AxisGroup(group, ranks, ranks.index(rank))
        if required:
            raise ValueError(
                f"mpu {type(mpu).__name__} has no get_{prefixes[0]}_group(): deepspeed.initialize"
                "(mpu=...) needs a Megatron-style object with get_data_parallel_group(), "
                "get_model_parallel_group() (and get_*_rank / get_*_world_size)"
            )
        return AxisGroup.solo(rank)

    data = axis(("data_parallel",), required=True)
    tensor = axis(("tensor_model_parallel", "slice_parallel", "model_parallel"), required=False)
    pipe = axis(("pipe_parallel", "pipeline_model_parallel"), required=False)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if data.size * tensor.size * pipe.size != world:
        raise ValueError(
            f"mpu {type(mpu).__name__}: data-parallel {data.size} x tensor-parallel "
            f"{tensor.size} x pipeline {pipe.size} != world size {world}; check its groups"
        )
    # the model group is every rank holding another part of this replica: tensor x pipe
    # (upstream's grid names it so; Megatron's older mpus call the tensor group "model")
    model = axis(("model_parallel",), required=False)
    if model.size != tensor.size * pipe.size:
        if tensor.size > 1 and pipe.size > 1:
            raise ValueError(
                f"mpu {type(mpu).__name__}: get_model_parallel_group() has {model.size} ranks, "
                f"but tensor x pipeline is {tensor.size * pipe.size}: give the mpu a "
                "model-parallel group spanning both (as PipelineParallelGrid does)"
            )
        model = tensor if tensor.size > 1 else pipe
    layout = ParallelLayout(data, tensor, pipe, model, None, f"mpu {type(mpu).__name__}")
    return layout


def layout_for(mpu: Any) -> ParallelLayout:
    """The layout of deepspeed.initialize(mpu=...): the world without one; a grid's own
    (PipelineParallelGrid carries it); else a Megatron-style mpu's groups."""
    if mpu is None:
        return world_layout()
    own = getattr(mpu, "layout", None)
    if isinstance(own, ParallelLayout):
        return own
    return layout_from_mpu(mpu)


def forget_groups() -> None:
    """Drop the module's own references to process groups (at exit)."""
    set_current(None)
    _solo_groups.clear()


def set_current(layout: ParallelLayout | None) -> None:
    global _current
    _current = layout


def current() -> ParallelLayout:
    """The layout deepspeed.initialize built; the whole world before any (or without a
    process group)."""
    if _current is not None:
        return _current
    return world_layout()


def resolve(group: Any) -> tuple[Any, int]:
    """(torch process group, size) of an AxisGroup or a plain group (None: the world)."""
    if isinstance(group, AxisGroup):
        return group.group, group.size
    if not dist.is_initialized():
        return group, 1
    return group, dist.get_world_size(group)


def axis_of(group: Any) -> AxisGroup:
    """An AxisGroup for a torch process group (None or WORLD: the whole world)."""
    if isinstance(group, AxisGroup):
        return group
    rank = dist.get_rank() if dist.is_initialized() else 0
    if group is None or not dist.is_initialized() or group is dist.group.WORLD:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return AxisGroup(None, tuple(range(world)), rank) if world > 1 else AxisGroup.solo(rank)
    ranks = tuple(dist.get_process_group_ranks(group))
    if rank not in ranks:
        raise ValueError(f"this rank ({rank}) is not in the given process group {list(ranks)}")
    return AxisGroup(group, ranks, ranks.index(rank)) if len(ranks) > 1 else AxisGroup.solo(rank)


def data_axis(data_parallel_group: Any = None, mpu: Any = None) -> AxisGroup:
    """The data-parallel AxisGroup from an explicit group, an mpu, or the current layout."""
    if data_parallel_group is not None:
        return axis_of(data_parallel_group)
    if mpu is not None:
        get = getattr(mpu, "get_data_parallel_group", None)
        if get is None:
            raise ValueError(
                f"mpu {type(mpu).__name__} has no get_data_parallel_group(): pass a "
                "Megatron-style mpu, or data_parallel_group=<process group>"
            )
        return axis_of(get())
    return current().data


def side_group(axis: AxisGroup) -> Any:
    """A gloo group over the same ranks as `axis`, for small host-side checks that must not
    queue behind the bulk collectives in flight on the axis's own group. Collective over
    the world: every rank calls it at the same point (each learns every rank's axis)."""
    if axis.size == 1 or not dist.is_initialized():
        return None
    if axis.group is None:  # the world
        return dist.new_group(backend="gloo")
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(axis.ranks))
    mine = None
    for ranks in sorted({tuple(r) for r in out}):
        g = dist.new_group(list(ranks), backend="gloo")
        if ranks == axis.ranks:
            mine = g
    return mine
