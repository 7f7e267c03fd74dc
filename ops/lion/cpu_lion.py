"""DeepSpeedCPULion: Lion on CPU tensors with the SIMD cpu_lion op."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepspeed_ext.op_builder import CPULionBuilder

from ..cpu_optimizer import CPUOptimizer, check_hparams


class DeepSpeedCPULion(CPUOptimizer):
    STATE_KEYS = ("exp_avg",)

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        check_hparams("DeepSpeedCPULion", lr, None, betas, weight_decay)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _load_op(self) -> Any:
        return CPULionBuilder().load()

    def _apply(self, op: Any, group: dict[str, Any], step: int, lists: dict[str, list]) -> None:
        beta1, beta2 = group["betas"]
        op.lion_step(
            lists["params"],
            lists["grads"],
            lists["exp_avg"],
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["weight_decay"]),
        )
