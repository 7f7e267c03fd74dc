"""`"pipeline_parallelism": {"num_stages": N}`: a plain model becomes a PipelineModule.

An nn.Sequential (its children in order) or a list of layers is cut into N stages with
`pipeline.partition` (default: balance parameters). The loss comes from the model's own
`loss_fn` attribute if it has one, else the last layer must return the loss. With
`pipeline.schedule` "dualpipev" (or "dualpipev-zb") it is cut into 2N stages as a
DualPipeVModule.
"""

from __future__ import annotations

from typing import Any

import torch

from .checks import V_SCHEDULES
from .dualpipev import DualPipeVModule
from .module import PipelineModule


def as_pipeline(model: Any, config: Any) -> Any:
    stages = config.pipeline_parallelism.num_stages
    if stages is None or isinstance(model, PipelineModule):
        return model
    if isinstance(model, torch.nn.Sequential):
        layers = list(model.children())
    elif isinstance(model, (list, tuple)) and all(callable(x) for x in model):
        layers = list(model)
    else:
        raise ValueError(
            f"pipeline_parallelism.num_stages={stages} needs a model given as a "
            f"torch.nn.Sequential or a list of layers, not {type(model).__name__}: list its "
            "layers, or build a deepspeed.pipe.PipelineModule yourself"
        )
    pipe = config.pipeline
    partition = pipe.partition if "partition" in pipe.model_fields_set else "parameters"
    tp = max(int(config.tensor_parallel.autotp_size), 1)
    topology = None
    if tp > 1:  # 3D: each stage's layers sliced over tp consecutive ranks
        from deepspeed_ext.comm import get_world_size
        from deepspeed_ext.comm.topology import PipeModelDataParallelTopology

        world = get_world_size()
        if world % (stages * tp):
            raise ValueError(
                f"pipeline_parallelism.num_stages {stages} x tensor_parallel.autotp_size {tp} "
                f"does not divide the world size {world}: launch a multiple of {stages * tp} "
                "ranks"
            )
        topology = PipeModelDataParallelTopology(
            num_pp=stages, num_mp=tp, num_dp=world // (stages * tp)
        )
    v = "schedule" in pipe.model_fields_set and pipe.schedule in V_SCHEDULES
    return (DualPipeVModule if v else PipelineModule)(
        layers,
        num_stages=stages,
        topology=topology,
        loss_fn=getattr(model, "loss_fn", None),
        partition_method=partition,
        seed_layers=bool(pipe.seed_layers),
        activation_checkpoint_interval=int(pipe.activation_checkpoint_interval),
    )
