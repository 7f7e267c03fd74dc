"""The optimizer step every engine runs at an accumulation boundary (the data-parallel
engine and the pipeline schedule alike).

[Note: optimizer step]
1. norm: the strategy's sum of squares over its data-parallel group, summed over the pipe
   group (each stage holds other parameters) and unscaled by the loss scale;
2. overflow: with fp16 (and bf16 with bf16.check_grad_overflow), a non-finite norm means
   some rank overflowed; every rank sees the same norm, so every rank skips together and
   the loss scale (fp16) backs off;
3. otherwise one multiply unscales and clips, the strategy hands the optimizer its grads,
   the optimizer steps, the strategy writes the masters back, the loss scale and LR
   schedule advance;
4. gradients are zeroed either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.comm import AxisGroup, sum_tensor_over
from deepspeed_ext.zero.protocol import GradientStrategy

from .grad_clip import clip_factor


@dataclass(frozen=True)
class StepOutcome:
    norm: float  # the unscaled global gradient norm (inf/nan on overflow)
    overflow: bool  # gradients not finite: the step was skipped
    # the sums over the pipe group of the caller's `pipe_extra` values
    pipe_sums: tuple[float, ...] = ()


def _vector_like(ref: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(ref.device, torch.float64).reshape(-1)
    return torch.full_like(ref, value).reshape(1)


def global_grad_norm(
    strategy: GradientStrategy,
    pipe: AxisGroup,
    inv_scale: float,
    replicated_sq: torch.Tensor | float = 0.0,
    pipe_extra: torch.Tensor | float = 0.0,
) -> tuple[float, tuple[float, ...]]:
    """The whole model's gradient norm, the same on every rank, and the pipe-group sums of
    `pipe_extra` (a number or a vector, the same length on every rank: a pipeline's loss
    rides along, one collective instead of two). replicated_sq: the part of this rank's sum
    of squares that another stage also holds (pipeline tied weights), so counted once. The
    sums stay on the device until the one host read of all of them."""
    sq = strategy.grad_sq_sum()
    own = (sq - _vector_like(sq, replicated_sq)).reshape(1)
    total, *extra = sum_tensor_over(torch.cat([own, _vector_like(sq, pipe_extra)]), pipe).tolist()
    norm = math.sqrt(max(total, 0.0)) * inv_scale if math.isfinite(total) else total
    return norm, tuple(extra)


def optimizer_step(
    strategy: GradientStrategy,
    optimizer: Any,
    loss_scaler: Any,
    lr_scheduler: Any,
    clip: float,
    pipe: AxisGroup,
    lr_kwargs: dict[str, Any],
    replicated_sq: torch.Tensor | float = 0.0,
    pipe_extra: torch.Tensor | float = 0.0,
    skip_nonfinite: bool = False,
) -> StepOutcome:
    inv_scale = 1.0 / loss_scaler.loss_scale if loss_scaler is not None else 1.0
    norm, pipe_sums = global_grad_norm(strategy, pipe, inv_scale, replicated_sq, pipe_extra)
    overflow = (skip_nonfinite or loss_scaler is not None) and not math.isfinite(norm)
    if overflow:
        if loss_scaler is not None:
            loss_scaler.update(True)
    else:
        strategy.scale_grads_(clip_factor(inv_scale, norm, clip))
        if optimizer is not None:
            strategy.before_step()
            strategy.optimizer_step(optimizer)
            strategy.after_step()
        if loss_scaler is not None:
            loss_scaler.update(False)
        if lr_scheduler is not None:
            lr_scheduler.step(**lr_kwargs)
    strategy.zero_grads()
    return StepOutcome(norm, overflow, pipe_sums)
