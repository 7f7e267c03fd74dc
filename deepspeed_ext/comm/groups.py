"""Upstream's `deepspeed.utils.groups` accessors, answered from the current parallel layout
([Note: parallel layout]). Before deepspeed.initialize builds one, the whole world is one
data-parallel group and every model-parallel axis has one rank."""

from __future__ import annotations

from typing import Any

from .expert_groups import ensure_expert_groups, expert_groups_made, expert_rank_lists
from .layout import current


def _get_data_parallel_group() -> Any:
    return current().data.process_group()


def _get_data_parallel_world_size() -> int:
    return current().data.size


def _get_data_parallel_rank() -> int:
    return current().data.rank


def _get_data_parallel_group_ranks() -> list[int]:
    return list(current().data.ranks)


def _get_broadcast_src_rank() -> int:
    """The global rank of data-parallel rank 0 (weights are broadcast from it)."""
    return current().data.global_rank(0)


def _get_model_parallel_world_size() -> int:
    return current().model.size


def get_data_parallel_group() -> Any:
    return _get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


def get_tensor_model_parallel_group() -> Any:
    return current().tensor.process_group()


def get_tensor_model_parallel_world_size() -> int:
    return current().tensor.size


def get_tensor_model_parallel_rank() -> int:
    return current().tensor.rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's group."""
    return current().tensor.global_rank(0)


def get_model_parallel_group() -> Any:
    return current().model.process_group()


def get_model_parallel_world_size() -> int:
    return current().model.size


def get_model_parallel_rank() -> int:
    return current().model.rank


def get_pipe_parallel_group() -> Any:
    return current().pipe.process_group()


def get_pipe_parallel_world_size() -> int:
    return current().pipe.size


def get_pipe_parallel_rank() -> int:
    return current().pipe.rank


# Sequence parallelism is not in the layout yet: one rank along it, so the
# sequence-and-data group is the data group (upstream's answer without sequence parallelism).
def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_data_parallel_group() -> Any:
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


# -- expert groups ([Note: expert groups]), by upstream's names; `group_name` is "ep_size_E" --
def _expert(group_name: str) -> Any:
    made = expert_groups_made()
    if group_name not in made:
        known = ", ".join(sorted(made)) or "none yet"
        raise KeyError(
            f"no expert group named {group_name!r} (made: {known}): groups are made when "
            "deepspeed.initialize sees an MoE layer with that ep_size"
        )
    return made[group_name]


def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    """Make the groups of ep_size expert_parallel_size_ under the current layout (collective)."""
    ensure_expert_groups(expert_parallel_size_, use_data_before_expert_parallel_)


def _get_expert_parallel_group(group_name: str) -> Any:
    return _expert(group_name).expert.process_group()


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {n: g.expert.process_group() for n, g in expert_groups_made().items()}


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _expert(group_name).expert_data.process_group()


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {n: g.expert_data.process_group() for n, g in expert_groups_made().items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert(group_name).expert.size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert(group_name).expert.rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    return _expert(group_name).expert.global_rank(0)


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert(group_name).expert_data.size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert(group_name).expert_data.rank


def _get_max_expert_size() -> int:
    """The largest ep_size among the groups made (1 when none)."""
    return max((g.ep_size for g in expert_groups_made().values()), default=1)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(group_name).expert.ranks)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(group_name).expert_data.ranks)


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank whose copy of these experts the others start from."""
    return _expert(group_name).expert_data.global_rank(0)


def _get_expert_model_parallel_world_size() -> int:
    """Experts are not sliced over the tensor-parallel group here (one rank along it)."""
    return 1


def _create_expert_data_and_model_parallel(
    expert_parallel_size_: int, mpu: Any = None, use_data_before_expert_parallel_: bool = False
) -> None:
    """The groups cut out of the layout's data-parallel groups (which an mpu given to
    deepspeed.initialize made); experts stay whole on each tensor-parallel rank."""
    ensure_expert_groups(expert_parallel_size_, use_data_before_expert_parallel_)


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel rank lists, expert-data-parallel rank lists) for a layout of
    pipeline-major, tensor-minor ranks, as upstream lays them out (no process group)."""
    tp, pp = tensor_parallel_size_, pipeline_parallel_size_
    if world_size % (tp * pp):
        raise ValueError(
            f"world_size {world_size} is not a multiple of tensor x pipeline size {tp * pp}"
        )
    per_stage = world_size // pp
    data = [
        list(range(start + i, start + per_stage, tp))
        for start in range(0, world_size, per_stage)
        for i in range(tp)
    ]
    return expert_rank_lists(data, expert_parallel_size_, use_data_before_expert_parallel_)
