"""`pipeline`: pipeline-parallel engine options (deepspeed.pipe)."""

from __future__ import annotations

from ..types import Auto, Bool, Int, Section, Str


class PipelineConfig(Section):
    # "auto" is upstream's real default here (stages from the topology), not a placeholder.
    stages: Auto | Int = "auto"
    # "parameters", "uniform", "type:<regex>" or upstream's default "best".
    partition: Str = "best"
    seed_layers: Bool = False
    activation_checkpoint_interval: Int = 0
    pipe_partitioned: Bool = True
    grad_partitioned: Bool = True
    # None: reentrant checkpointing (upstream's default).
    use_reentrant: Bool | None = None
