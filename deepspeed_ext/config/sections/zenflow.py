"""`zero_optimization.zenflow`: selective (top-k column) gradient updates."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..types import Auto, Bool, Float, Int, Section


class ZenFlowConfig(Section):
    topk_ratio: Float = Field(default=0.1, gt=0.0, lt=1.0)
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    # "auto" is a real upstream value here, not a placeholder.
    select_interval: Auto | Int = "auto"
    update_interval: Auto | Int = "auto"
    overlap_step: Bool = False
    offload: Bool = False
    auto_ratio: Float = Field(default=0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: Int = 0
    pt_reserved_cores_perc: Float = Field(default=0.5, ge=0.0, le=1.0)

    def active(self) -> bool:
        return True  # present means on
