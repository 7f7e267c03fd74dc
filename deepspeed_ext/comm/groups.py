"""Upstream's `deepspeed.utils.groups` accessors, answered from the current parallel layout
([Note: parallel layout]). Before deepspeed.initialize builds one, the whole world is one
data-parallel group and every model-parallel axis has one rank."""

from __future__ import annotations

from typing import Any

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
