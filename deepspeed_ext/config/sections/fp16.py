"""`fp16`: mixed precision with fp16 weights and a loss scaler."""

from __future__ import annotations

from pydantic import Field

from ..types import Bool, Float, Int, Section


class FP16Config(Section):
    enabled: Bool = False
    # Cast the module's floating-point inputs to fp16 in forward.
    auto_cast: Bool = False
    # 0 selects dynamic loss scaling; any positive value is a fixed (static) scale.
    loss_scale: Float = Field(default=0.0, ge=0)
    # Dynamic scaling starts at 2**initial_scale_power; past 2**127 the scaled loss is inf
    # in fp32 and every step would be skipped until the scale came down
    initial_scale_power: Int = Field(default=16, le=127)
    # window and floor must be > 0 when scaling is dynamic (checks.py: unused otherwise).
    loss_scale_window: Int = 1000
    # overflows tolerated before the scale drops: 0 would never drop it
    hysteresis: Int = Field(default=2, ge=1)
    consecutive_hysteresis: Bool = False
    # A float floor such as 1e-5 is meaningful (upstream's type is int; guides give floats).
    min_loss_scale: Float = 1.0
    fp16_master_weights_and_grads: Bool = False

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0
