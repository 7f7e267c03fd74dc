"""Warmup schedules: WarmupLR (warm up, then hold), WarmupDecayLR (then linear decay),
WarmupCosineLR (then cosine decay, as a ratio of the optimizer's own lr).

Warmup fraction g at batch i < N (N = max(2, warmup_num_steps)):
    log:    g = ln(i + 1) / ln(N)
    linear: g = i / N
"""

from __future__ import annotations

import logging
import math

from ...config.sections.scheduler import step_count_problem
from .base import BatchSchedule, FloatOrList, OptimizerLike, number, per_group
from .constants import (
    COS_MIN_RATIO,
    WARMUP_LINEAR_RATE,
    WARMUP_LOG_RATE,
    WARMUP_MAX_LR,
    WARMUP_MIN_LR,
    WARMUP_MIN_RATIO,
    WARMUP_NUM_STEPS,
)

logger = logging.getLogger(__name__)


def _check_warmup_type(warmup_type: str) -> str:
    # Upstream falls back to log on an unknown type rather than failing; configs rely on it.
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        logger.warning(
            "unknown warmup_type %r (expected 'log' or 'linear'); using 'log'", warmup_type
        )
        return WARMUP_LOG_RATE
    return warmup_type


def _check_num_steps(warmup_num_steps: object) -> int:
    # As upstream: an int of 1 or more (1 then counts as 2, below); 0 or 10.0 are refused.
    problem = step_count_problem(WARMUP_NUM_STEPS, warmup_num_steps)
    if problem:
        raise ValueError(problem)
    assert isinstance(warmup_num_steps, int)
    return warmup_num_steps


def _warmup_fraction(batch: int, num_steps: int, warmup_type: str) -> float:
    if warmup_type == WARMUP_LINEAR_RATE:
        return batch / num_steps
    return math.log(batch + 1) / math.log(num_steps)


class WarmupLR(BatchSchedule):
    """lr = min_lr + (max_lr - min_lr) * g during warmup, then max_lr; per param group.

    warmup_max_lr None (WarmupLR's default, as upstream) is each group's own lr as the
    schedule is built: the warmup rises to the lr the optimizer was given.
    """

    def __init__(
        self,
        optimizer: OptimizerLike,
        warmup_min_lr: FloatOrList = 0.0,
        warmup_max_lr: FloatOrList | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        num_steps = _check_num_steps(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, WARMUP_MIN_LR)
        if warmup_max_lr is None:
            self.max_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        else:
            self.max_lrs = per_group(self.optimizer, warmup_max_lr, WARMUP_MAX_LR)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, num_steps)  # ln(1) = 0 would divide by zero
        self.warmup_type = _check_warmup_type(warmup_type)
        self._start()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then gamma = max(0, (T - i) / max(1, T - N)) with T = total_num_steps.

    Unlike WarmupLR, warmup_max_lr defaults to 0.001 (upstream's defaults differ so); None
    given explicitly is each group's own lr, as for WarmupLR.
    """

    def __init__(
        self,
        optimizer: OptimizerLike,
        total_num_steps: int,
        warmup_min_lr: FloatOrList = 0.0,
        warmup_max_lr: FloatOrList | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps  # set first: _get_gamma may run inside super()
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                self.warmup_num_steps,
            )

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._get_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(BatchSchedule):
    """lr = base_lr * ratio, base_lr being each group's lr when the schedule was built.

    warmup (i < N): ratio = w + (1 - w) * g               (w = warmup_min_ratio)
    after:          ratio = max(0, c + (1 - c) * (1 + cos(pi * s / (T - N))) / 2)
                    with s = min(i - N + 1, T - N)        (c = cos_min_ratio)
    """

    def __init__(
        self,
        optimizer: OptimizerLike,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        num_steps = _check_num_steps(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = number(warmup_min_ratio, WARMUP_MIN_RATIO)
        self.warmup_num_steps = max(2, num_steps)
        self.cos_min_ratio = number(cos_min_ratio, COS_MIN_RATIO)
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                self.warmup_num_steps,
            )
        # The peak lrs: read once, because the schedule overwrites the groups' lr from here on.
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            # Not started: the value batch 0 will get (upstream writes 0.0, the same for w = 0).
            return self.warmup_min_ratio
        if i < self.warmup_num_steps:
            g = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        span = self.total_num_steps - self.warmup_num_steps
        if span <= 0:  # no room for a cosine phase: already at its floor
            return max(0.0, self.cos_min_ratio)
        # Clamped so that running past total_num_steps holds the floor instead of rising again.
        s = min(i - self.warmup_num_steps + 1, span)
        cosine = (1.0 + math.cos(math.pi * s / span)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]
