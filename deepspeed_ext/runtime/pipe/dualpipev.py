"""DualPipeV (DeepSeek-V3's pipeline schedule; upstream's DualPipeVModule and DualPipeVEngine).

The model is cut into 2p stages for p pipeline ranks and laid out as a V: rank r holds stage
r (phase 0, activations flowing towards the last rank) and stage 2p-1-r (phase 1, flowing
back). A micro-batch goes out through the phase-0 stages, turns around on the last rank
(handed from its phase-0 chunk to its phase-1 chunk in-process, no message) and ends on rank
0, which therefore both reads the data and computes the loss; embeddings tied to the output
head sit on one rank and need no gradient exchange. DualPipeVSchedule (schedule.py) overlaps
the two phases so the pipe fills from both ends.

The phases are model chunks 0 and 1 to the engine: everything the pipeline engine does for
interleaved chunks (buffers, p2p channels per chunk, checkpoints by global layer index)
applies; the V only changes which rank holds which part (chunk_stage / stage_chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepspeed_ext.comm import ProcessTopology

from .engine import PipelineEngine
from .module import PipelineModule
from .schedule import DualPipeVSchedule, PipeSchedule


class DualPipeVModule(PipelineModule):
    """A PipelineModule cut into 2 * num_stages stages, rank r building stages r and
    2 * num_stages - 1 - r. `num_stages` (or the topology's pipe dimension) counts pipeline
    ranks, as for PipelineModule, and stays so (upstream's module doubles its num_stages
    once built); `parts` has 2 * num_stages + 1 boundaries, as upstream's. The other
    arguments are PipelineModule's."""

    pipe_layout = "v"

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        *args: Any,  # PipelineModule's, in upstream's order (loss_fn, seed_layers, ...)
        **kwargs: Any,
    ) -> None:
        chunks = kwargs.pop("virtual_stages", 2)
        if chunks != 2:
            raise ValueError(
                f"DualPipeVModule(virtual_stages={chunks}): DualPipeV holds exactly two stages "
                "per rank; drop virtual_stages (or use PipelineModule for interleaving)"
            )
        ranks = topology.get_dim("pipe") if topology is not None else num_stages
        if isinstance(ranks, int) and 0 < len(layers) < 2 * ranks:
            raise ValueError(
                f"DualPipeVModule with {ranks} pipeline stages cuts the model into "
                f"{2 * ranks} stages of at least one layer, but it has {len(layers)} layers: "
                f"use at most {len(layers) // 2} stages"
            )
        if len(args) > 9:  # loss_fn ... dynamic_shape; the next would be virtual_stages
            raise TypeError(f"DualPipeVModule takes PipelineModule's arguments: {len(args)} extra")
        kwargs["virtual_stages"] = 2
        super().__init__(layers, num_stages, topology, *args, **kwargs)
        self.active_phase = 0

    def chunk_stage(self, chunk: int, stage_id: int | None = None) -> int:
        s = self.stage_id if stage_id is None else stage_id
        return s if chunk == 0 else 2 * self.num_stages - 1 - s

    def stage_chunk(self, virtual_stage: int) -> tuple[int, int]:
        p = self.num_stages
        return (virtual_stage, 0) if virtual_stage < p else (2 * p - 1 - virtual_stage, 1)

    # -- upstream's names for the two halves --
    @property
    def phase_bounds(self) -> list[tuple[int, int]]:
        """[start, stop) global layer indices of phase 0 and phase 1 on this rank."""
        return list(self.chunk_ranges)

    def activate_phase(self, phase: int) -> None:
        """Make `phase` the one forward() runs when given no chunk."""
        if phase not in (0, 1):
            raise ValueError(f"activate_phase({phase!r}): DualPipeV's phases are 0 and 1")
        self.active_phase = phase

    def forward(self, forward_input: Any, chunk: int | None = None) -> Any:
        if chunk is not None:  # the engine's call: the phase running, for hooks that ask
            self.active_phase = chunk
        return super().forward(forward_input, self.active_phase)


class DualPipeVEngine(PipelineEngine):
    """deepspeed.initialize's engine for a DualPipeVModule: the pipeline engine running
    DualPipeVSchedule (with `"pipeline": {"schedule": "dualpipev-zb"}` its backwards split
    into input- and weight-gradient passes). gradient_accumulation_steps must be at least
    2 * num_stages."""

    layouts = ("v",)

    def __init__(self, model: DualPipeVModule, config: Any, **kwargs: Any) -> None:
        if not isinstance(model, DualPipeVModule):
            raise TypeError(
                f"DualPipeVEngine runs a DualPipeVModule, not a {type(model).__name__}: build "
                "the model with deepspeed.pipe.DualPipeVModule (or use PipelineEngine)"
            )
        super().__init__(model, config, **kwargs)
        if self.micro_batches < 2 * self.num_stages:
            raise ValueError(
                f"gradient_accumulation_steps={self.micro_batches} with a DualPipeVModule of "
                f"{self.num_stages} pipeline stages: DualPipeV fills the pipe from both ends "
                f"and needs at least 2 * num_stages = {2 * self.num_stages} micro-batches a "
                "batch; raise gradient_accumulation_steps (or train_batch_size)"
            )

    def _train_schedule(self) -> PipeSchedule:
        split = self.schedule_name == "dualpipev-zb"
        return DualPipeVSchedule(
            self.micro_batches, self.num_stages, self.stage_id, split_backward=split
        )

    def _inference_schedule(self, micro_batches: int) -> PipeSchedule:
        return DualPipeVSchedule(micro_batches, self.num_stages, self.stage_id, forward_only=True)


__all__ = ["DualPipeVEngine", "DualPipeVModule"]
