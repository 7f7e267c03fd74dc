"""PipelineParallelGrid: upstream's mpu-style view of a topology's process groups.

It builds a ParallelLayout from the topology ([Note: parallel layout]) and answers the
get_*_parallel_{rank,world_size,group} questions Megatron-style code asks. Constructing it is
collective: every rank builds the same groups in the same order.
"""

from __future__ import annotations

from typing import Any

from .checked import dist
from .layout import ParallelLayout, layout_from_topology
from .topology import ProcessTopology, default_pipe_data_topology


class PipelineParallelGrid:
    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        if process_group is not None:
            raise ValueError(
                "PipelineParallelGrid(process_group=...): a grid spans the whole world; "
                "pass topology= only"
            )
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._topo = (
            topology if topology is not None else default_pipe_data_topology(self.world_size)
        )
        self.layout: ParallelLayout = layout_from_topology(self._topo, "PipelineParallelGrid")
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        lay = self.layout
        self.dp_group, self.dp_proc_group = list(lay.data.ranks), lay.data.process_group()
        self.pp_group, self.pp_proc_group = list(lay.pipe.ranks), lay.pipe.process_group()
        self.slice_group = list(lay.tensor.ranks)
        self.slice_proc_group = lay.tensor.process_group()
        self.ds_model_proc_group = lay.model.process_group()
        self.ds_model_rank = lay.model.rank
        self.ds_model_world_size = lay.model.size
        self.dp_groups = self._topo.get_axis_comm_lists("data")
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe")
        self.p2p_groups = self._p2p_pairs()

    def _coord(self, axis: str) -> int:
        c = self._topo.get_coord(self.global_rank)
        return int(getattr(c, axis)) if axis in self._topo.get_axis_names() else 0

    def _p2p_pairs(self) -> list[list[int]]:
        """[rank, next stage's rank in the same pipeline] for every rank (wrapping around)."""
        pairs = []
        lists = self.pipe_groups or [[r] for r in range(self.world_size)]
        owner = {r: lst for lst in lists for r in lst}
        for r in range(self.world_size):
            lst = owner[r]
            pairs.append([r, lst[(lst.index(r) + 1) % len(lst)]])
        return pairs

    def get_stage_id(self) -> int:
        return self._coord("pipe")

    def get_data_parallel_id(self) -> int:
        return self._coord("data")

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` in this rank's pipeline (other coordinates as given,
        else this rank's)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    # pipeline
    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    # data
    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    # model parallel: every kind together (pipe x tensor), for norms and overflow checks
    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    # tensor slicing
    def get_slice_parallel_rank(self) -> int:
        return self._coord("model")

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group
