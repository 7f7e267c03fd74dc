"""LRRangeTest: grow the lr from a floor to find the largest one that still trains.

lr = min_lr * (1 + step_rate * k), k = (i + 1) / step_size, floored when staircase.
"""

from __future__ import annotations

import math

from ...config.sections.scheduler import step_count_problem
from .base import BatchSchedule, FloatOrList, OptimizerLike, per_group
from .constants import LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_SIZE


class LRRangeTest(BatchSchedule):
    def __init__(
        self,
        optimizer: OptimizerLike,
        lr_range_test_min_lr: FloatOrList = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, LR_RANGE_TEST_MIN_LR)
        problem = step_count_problem(LR_RANGE_TEST_STEP_SIZE, lr_range_test_step_size)
        if problem:  # as upstream: an int of 1 or more
            raise ValueError(problem)
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def _interval(self) -> float:
        k = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(k)) if self.staircase else k

    def get_lr(self) -> list[float]:
        increase = 1.0 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        self._advance(batch_iteration)
