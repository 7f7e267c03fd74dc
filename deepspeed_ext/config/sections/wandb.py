"""`wandb`: send the step metrics to Weights & Biases."""

from __future__ import annotations

from ..types import Bool, Section, Str


class WandbConfig(Section):
    enabled: Bool = False
    group: Str | None = None
    team: Str | None = None
    project: Str = "deepspeed"
