"""DeepSpeedCPUAdam: Adam/AdamW on CPU tensors with the SIMD cpu_adam op."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepspeed_ext.op_builder import CPUAdamBuilder

from ..cpu_optimizer import CPUOptimizer, check_hparams


class DeepSpeedCPUAdam(CPUOptimizer):
    """Upstream's constructor: adamw_mode=True gives AdamW, False gives Adam with L2 decay."""

    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        check_hparams("DeepSpeedCPUAdam", lr, eps, betas, weight_decay)
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam does not support amsgrad=True")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
        )
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.adam_w_mode = adamw_mode

    def _load_op(self) -> Any:
        return CPUAdamBuilder().load()

    def _apply(self, op: Any, group: dict[str, Any], step: int, lists: dict[str, list]) -> None:
        beta1, beta2 = group["betas"]
        op.adam_step(
            lists["params"],
            lists["grads"],
            lists["exp_avg"],
            lists["exp_avg_sq"],
            step,
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group.get("bias_correction", True)),
            self.adam_w_mode,
        )
