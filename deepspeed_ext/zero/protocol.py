"""The gradient-strategy protocol: what the engine, the optimizer step and checkpoints may
call on stage 0, ZeRO 1/2 and ZeRO 3 alike, and the one context they are built from.

[Note: gradient strategy]
A strategy owns where gradients live and how they are reduced over the data-parallel group,
and what the optimizer steps (fp32 masters, whole or partitioned). The engine's calls, in
order: attach_optimizer(opt) once; per micro-step begin_backward(boundary), backward, and
end_backward() (also queued as an autograd callback, so a plain loss.backward() leaves
nothing pending: [Note: end of backward]); on a boundary the optimizer step
(runtime/optimizer_step.py) calls grad_sq_sum(), scale_grads_(f), before_step(),
optimizer_step(opt), after_step(), then zero_grads().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deepspeed_ext.comm import AxisGroup


@dataclass(frozen=True)
class StrategyContext:
    module: torch.nn.Module
    model_groups: list[dict[str, Any]]  # the model's param groups (params + options)
    accum_dtype: torch.dtype  # gradient accumulation dtype
    bucket_numel: int  # elements per reduction bucket
    device: torch.device  # where the model computes
    optimizer_device: torch.device  # where masters and optimizer states live
    data: AxisGroup  # the data-parallel group (comm/layout.py)
    global_rank: int  # unique per process: names per-process files (NVMe swap)
    zero: Any = None  # the zero_optimization config section
    aio: dict[str, Any] = field(default_factory=dict)  # the aio config section
    # whether the micro-step under way ends an accumulation window: asked when a backward
    # the engine did not begin (a plain loss.backward()) produces its first gradient
    is_boundary: Callable[[], bool] = lambda: True


class GradientStrategy(Protocol):
    stage: int
    sync_enabled: bool  # False inside engine.no_sync()
    mixed_grads_ok: bool  # the optimizer takes 16-bit grads for fp32 masters

    def optimizer_param_groups(self) -> list[dict[str, Any]]: ...
    def repoint(self, optimizer: torch.optim.Optimizer) -> None: ...
    def attach_optimizer(self, optimizer: Any) -> None: ...
    def begin_backward(self, boundary: bool) -> None: ...
    def end_backward(self) -> None: ...
    def grad_sq_sum(self) -> float: ...
    def scale_grads_(self, factor: float) -> None: ...
    def before_step(self) -> None: ...
    def optimizer_step(self, optimizer: Any) -> None: ...
    def after_step(self) -> None: ...
    def zero_grads(self) -> None: ...
    def remove_hooks(self) -> None: ...
    def sync_masters_from_model(self) -> None: ...
