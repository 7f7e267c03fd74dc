"""deepspeed_ext.comm: the only module that imports torch.distributed (layer 3).

Upstream's `deepspeed.comm` names: init_distributed, is_initialized, get_rank, ...
"""

from . import waits
from .averaging import MEAN, GradAverage
from .bucketed import GradBuckets
from .cast import CastBack, in_dtype
from .collectives import (
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    get_backend,
    group_broadcast,
    group_broadcast_many,
    new_group,
)
from .comms_logging import comms_logger
from .comms_summary import configure, log_summary
from .env import DistEnv, discover, free_port
from .grid import PipelineParallelGrid
from .hierarchical import NodeGroups, node_groups, reduce_scatter_bucket_hierarchical
from .init import (
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    release_at_exit,
)
from .layout import (
    AxisGroup,
    ParallelLayout,
    layout_from_mpu,
    layout_from_topology,
    world_layout,
)
from .sharded import (
    all_gather_bucket,
    all_reduce_bucket,
    collective_device,
    reduce_scatter_bucket,
    sum_over,
    sum_tensor_over,
    sums_over,
)
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "CastBack",
    "in_dtype",
    "waits",
    "NodeGroups",
    "node_groups",
    "reduce_scatter_bucket_hierarchical",
    "comms_logger",
    "configure",
    "log_summary",
    "AxisGroup",
    "DistEnv",
    "ParallelLayout",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "group_broadcast",
    "group_broadcast_many",
    "layout_from_mpu",
    "layout_from_topology",
    "world_layout",
    "GradAverage",
    "MEAN",
    "GradBuckets",
    "ReduceOp",
    "collective_device",
    "all_gather",
    "all_gather_bucket",
    "sum_over",
    "sum_tensor_over",
    "sums_over",
    "reduce_scatter_bucket",
    "all_reduce_bucket",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "destroy_process_group",
    "discover",
    "free_port",
    "get_backend",
    "get_local_rank",
    "release_at_exit",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "new_group",
]
