"""DeepSpeedCPUAdagrad: Adagrad on CPU tensors with the SIMD cpu_adagrad op."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepspeed_ext.op_builder import CPUAdagradBuilder

from ..cpu_optimizer import CPUOptimizer, check_hparams


class DeepSpeedCPUAdagrad(CPUOptimizer):
    STATE_KEYS = ("exp_avg_sq",)

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        check_hparams("DeepSpeedCPUAdagrad", lr, eps, None, weight_decay)
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad does not support amsgrad=True")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _load_op(self) -> Any:
        return CPUAdagradBuilder().load()

    def _apply(self, op: Any, group: dict[str, Any], step: int, lists: dict[str, list]) -> None:
        op.adagrad_step(
            lists["params"],
            lists["grads"],
            lists["exp_avg_sq"],
            float(group["lr"]),
            float(group["eps"]),
            float(group["weight_decay"]),
        )
