"""How gradients are scaled around their data-parallel sum: upstream's gradient_allreduce_op,
prescale_gradients and gradient_predivide_factor. All give the mean over ranks (or the sum,
with "sum"); they differ in where the division happens, which matters for 16-bit range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GradAverage:
    average: bool = True  # False: gradient_allreduce_op "sum"
    prescale: bool = False  # divide by the world size before the sum
    predivide: float = 1.0  # otherwise: divide by this before, by world/this after

    @classmethod
    def from_config(cls, config: Any) -> GradAverage:
        return cls(
            average=config.gradient_allreduce_op == "mean",
            prescale=bool(config.prescale_gradients),
            predivide=float(config.gradient_predivide_factor),
        )

    def factors(self, world: int) -> tuple[float, float]:
        """(before, after) the collective sum."""
        if not self.average:
            return 1.0, 1.0
        if self.prescale:
            return 1.0 / world, 1.0
        return 1.0 / self.predivide, self.predivide / world


MEAN = GradAverage()  # the default: divide by the world size after the sum, as DDP
