"""OneCycle: one triangular cycle of lr (momentum inversely), then an optional decay.

Cycle (i < L1 + L2, L = L1 + L2, r = L1 / L):
    b = i + 1;  x = 1 + b / L - floor(1 + b / L)
    s = x / r if x <= r else (x - 1) / (r - 1)            (0 -> 1 -> 0 over the cycle)
    lr  = min_lr + (max_lr - min_lr) * s
    mom = max_mom - (max_mom - min_mom) * s
Stairs (n1 = cycle_first_stair_count, n2 = cycle_second_stair_count, n2 left out = n1):
s climbs and falls in n equal stairs per half instead of moving every batch. The half's
count n is picked by x as above (0 or less: no stairs, s as above); with k = b mod L, the
batch's place in the cycle:
    k <= L1: s = floor(k * n / L1) / n
    else:    s = floor((L - k) * n / L2) / n
The stair is counted from the integer k, not by flooring the float s, which can land a hair
under a whole stair at a half's end and drop a stair (upstream computes it alike).
Decay (d = i - L + 1, only when decay_step_size and the rate are non-zero):
    lr  = min_lr / (1 + decay_lr_rate * d / decay_step_size)
    mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)
otherwise lr holds at min_lr and mom at max_mom.

Momentum is beta1 of optimizers with `betas` in their defaults (Adam family); for any other
optimizer (SGD included) cycling is turned off with a warning, as upstream does.
"""

from __future__ import annotations

import logging
import math

from .base import BatchSchedule, FloatOrList, OptimizerLike, per_group
from .constants import (
    CYCLE_FIRST_STAIR_COUNT,
    CYCLE_MAX_LR,
    CYCLE_MAX_MOM,
    CYCLE_MIN_LR,
    CYCLE_MIN_MOM,
    CYCLE_SECOND_STAIR_COUNT,
)

logger = logging.getLogger(__name__)


def _stair_count(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of stairs (0 or less: no stairs), got {value!r}")
    return value


class OneCycle(BatchSchedule):
    def __init__(
        self,
        optimizer: OptimizerLike,
        cycle_min_lr: FloatOrList,
        cycle_max_lr: FloatOrList,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: FloatOrList = 0.8,
        cycle_max_mom: FloatOrList = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        self.total_size = first + second
        if first <= 0 or second < 0:
            raise ValueError(
                f"cycle step sizes must be first > 0, second >= 0; got {first:g}, {second:g}"
            )
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = _stair_count(cycle_first_stair_count, CYCLE_FIRST_STAIR_COUNT)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _stair_count(cycle_second_stair_count, CYCLE_SECOND_STAIR_COUNT)
        )
        self.decay_step_size = decay_step_size

        self.min_lrs = per_group(self.optimizer, cycle_min_lr, CYCLE_MIN_LR)
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, CYCLE_MAX_LR)
        self.decay_lr_rate = decay_lr_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)

        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in self.optimizer.defaults:
            logger.warning(
                "cycle_momentum is disabled: %s has no `betas` in its defaults",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
        self.min_moms = per_group(self.optimizer, cycle_min_mom, CYCLE_MIN_MOM)
        self.max_moms = per_group(self.optimizer, cycle_max_mom, CYCLE_MAX_MOM)
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self._start()

    def _scale(self) -> float:
        batch = self.last_batch_iteration + 1
        b = batch / self.total_size
        x = 1.0 + b - math.floor(1.0 + b)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1.0) / (self.step_ratio - 1.0), self.second_stair_count
        if stairs <= 0:
            return scale
        k = batch % self.total_size
        if k <= self.first_step_size:
            position = k * stairs / self.first_step_size
        else:
            position = (self.total_size - k) * stairs / self.second_step_size
        return math.floor(position) / stairs

    def _decay_batch(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_batch()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Per group (beta1, beta2), beta1 following the schedule; None when not cycling."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            beta1 = [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        elif self.skip_mom_decay:
            beta1 = list(self.max_moms)
        else:
            factor = 1.0 + self.decay_mom_rate * self._decay_batch()
            beta1 = [hi * factor for hi in self.max_moms]
        # beta2 stays the group's own (upstream pins it to 0.99, silently changing Adam's).
        groups = self.optimizer.param_groups
        return [(b1, float(g["betas"][1])) for b1, g in zip(beta1, groups)]

    def step(self, batch_iteration: int | None = None) -> None:
        self._advance(batch_iteration)

    def _apply(self) -> None:
        super()._apply()
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms):
                group["betas"] = betas
