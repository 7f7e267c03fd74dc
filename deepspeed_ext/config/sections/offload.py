"""`zero_optimization.offload_param` and `zero_optimization.offload_optimizer`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..types import Bool, Float, Int, Section, Str, ToLower

OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], ToLower]


class OffloadParamConfig(Section):
    """Parameters offloaded to CPU or NVMe (ZeRO stage 3)."""

    device: OffloadDevice = "none"
    # Required when device is "nvme" (checks.py).
    nvme_path: Str | None = None
    buffer_count: Int = Field(default=5, ge=0)
    buffer_size: Int = Field(default=100_000_000, ge=0)
    # Parameter elements kept in CPU memory when offloading to NVMe.
    max_in_cpu: Int = Field(default=1_000_000_000, ge=0)
    pin_memory: Bool = True


class OffloadOptimizerConfig(Section):
    """Optimizer state (and step) offloaded to CPU or NVMe (ZeRO stages 1-3)."""

    device: OffloadDevice = "none"
    # Required when device is "nvme" (checks.py).
    nvme_path: Str | None = None
    buffer_count: Int = Field(default=4, ge=0)
    pin_memory: Bool = True
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    # A deepspeed_ext key: NVMe state steps during the backward ([Note: optimizer steps in
    # backward]); refused with clipping and overflow checks (checks.py).
    step_in_backward: Bool = False
    # A deepspeed_ext key: NVMe state steps in the next forward, each sub-group before its
    # parameters' first gather ([Note: optimizer steps in forward]). Unset: on with device
    # "nvme" at stage 3 unless step_in_backward is set; true: refused unless it applies
    # (checks.py); false: the step runs in engine.step().
    step_in_forward: Bool | None = None
    fast_init: Bool = False
    # Fraction of the optimizer step done on CPU; below 1.0 only with stage 3 (checks.py).
    ratio: Float = Field(default=1.0, ge=0.0, le=1.0)
    super_offload: Bool = False
    cpuadam_cores_perc: Float = Field(default=0.8, ge=0.0, le=1.0)

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write
