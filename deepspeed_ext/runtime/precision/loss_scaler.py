"""fp16 loss scaling with upstream's semantics.

[Note: dynamic loss scale]
The scale starts at 2**initial_scale_power. An overflowing step (inf/nan in any rank's
gradients) is skipped; the scale halves once `hysteresis` overflows have been absorbed
(consecutive_hysteresis: the allowance refills after every clean step, else only when the
scale grows), never below min_loss_scale. After loss_scale_window steps without overflow the
scale doubles. An overflow with the scale already at its minimum and the allowance used up
means fp16 cannot represent this model's gradients: training stops with LossScaleError,
which recommends bf16, instead of skipping every step forever.
"""

from __future__ import annotations

from typing import Any


class LossScaleError(RuntimeError):
    pass


class StaticLossScaler:
    dynamic = False

    def __init__(self, scale: float) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler(StaticLossScaler):
    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
        advice: str | None = None,
    ) -> None:
        super().__init__(init_scale)
        self.advice = advice  # the LossScaleError's way out (the fp16 section's by default)
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.scale_factor = scale_factor
        self.cur_hysteresis = hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                # at the minimum already (upstream's test: a scale set below the minimum
                # is raised to it by its first overflow, not stopped)
                if self.cur_scale == self.min_scale:
                    advice = self.advice or (
                        'Train in bf16 instead ("bf16": {"enabled": true}, "fp16": '
                        '{"enabled": false}), or lower fp16.min_loss_scale.'
                    )
                    raise LossScaleError(
                        f"fp16 gradients overflow even at the minimum loss scale "
                        f"({self.min_scale:g}), step after step: fp16 cannot represent this "
                        f"model's gradients. {advice}"
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # upstream's count: grown once scale_window clean steps have followed the step
            # after the last overflow (the first step counts as following an overflow at -1)
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "cur_scale": self.cur_scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """A static scaler's state ({"cur_scale"} alone: the run had a fixed loss_scale)
        starts the dynamic one at that scale."""
        self.cur_scale = float(sd["cur_scale"])
        self.cur_hysteresis = int(sd.get("cur_hysteresis", self.hysteresis))
        self.cur_iter = int(sd.get("cur_iter", 0))
        self.last_overflow_iter = int(sd.get("last_overflow_iter", self.cur_iter - 1))


def make_loss_scaler(fp16: Any) -> StaticLossScaler:
    """From the fp16 config section: loss_scale 0 means dynamic."""
    if fp16.loss_scale and float(fp16.loss_scale) > 0:
        return StaticLossScaler(float(fp16.loss_scale))
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )
