"""`pipeline`: pipeline-parallel engine options (deepspeed.pipe)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..types import Auto, Bool, Int, Section, Str


class PipelineConfig(Section):
    # "auto" is upstream's real default here (stages from the topology), not a placeholder.
    stages: Auto | Int = "auto"
    # "parameters", "uniform", "type:<regex>" or upstream's default "best".
    partition: Str = "best"
    seed_layers: Bool = False
    activation_checkpoint_interval: Annotated[Int, Field(ge=0)] = 0
    pipe_partitioned: Bool = True
    grad_partitioned: Bool = True
    # None: the non-reentrant checkpoint, or the reentrant one (upstream's default) with
    # activation_checkpointing.partition_activations on, as that one partitions.
    use_reentrant: Bool | None = None
    # deepspeed_ext: "1f1b" (upstream's TrainSchedule), "interleaved" (virtual stages: the
    # PipelineModule built with virtual_stages >= 2, which selects it by itself), "zb-h1"
    # (zero bubble: each backward split into input- and weight-gradient passes) or
    # "dualpipev" (a DualPipeVModule, which selects it by itself; with the
    # pipeline_parallelism key it cuts the plain model as one) or "dualpipev-zb" (the same,
    # each backward split as zb-h1 splits it, its weight pass right after the input
    # gradients are sent).
    schedule: Literal["1f1b", "interleaved", "zb-h1", "dualpipev", "dualpipev-zb"] = "1f1b"


class PipelineParallelismConfig(Section):
    """deepspeed_ext's `pipeline_parallelism` (the key widely read guides print; upstream has
    none): a plain nn.Sequential or list of layers given to deepspeed.initialize becomes a
    PipelineModule with this many stages, partitioned by `pipeline.partition`."""

    num_stages: Annotated[Int, Field(gt=0)] | None = None

    def active(self) -> bool:
        return self.num_stages is not None
