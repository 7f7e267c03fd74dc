"""FusedAdam: multi-tensor Adam/AdamW. CUDA tensors go through the fused_adam kernel
(one launch for many tensors); CPU tensors through the cpu_adam SIMD kernel, as upstream
does on its CPU accelerator."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepspeed_ext.op_builder import CPUAdamBuilder

from ..cpu_optimizer import check_hparams
from ..fused_optimizer import FusedOptimizer


class FusedAdam(FusedOptimizer):
    """Upstream's FusedAdam API. Optimizer states are fp32 for every param dtype, so fp16
    and bf16 params keep full-precision moments (upstream keeps them in the param dtype)."""

    NAME = "FusedAdam"
    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        check_hparams("FusedAdam", lr, eps, betas, weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = adam_w_mode

    def _builder(self, device_type: str) -> Any:
        if device_type == "cuda":
            from deepspeed_ext.op_builder.fused_adam import FusedAdamBuilder

            return FusedAdamBuilder
        return CPUAdamBuilder if device_type == "cpu" else None

    def _adopt(self, group: dict[str, Any]) -> None:
        """torch's Adam counts steps per param: a state dict of its gives the group's count
        (the params of a group step together), or the bias correction would start over."""
        if "step" in group:
            return
        counts = [self.state[p].pop("step") for p in group["params"] if "step" in self.state[p]]
        if counts:
            group["step"] = max(int(c) for c in counts)

    def _begin_group(self, group: dict[str, Any]) -> None:
        # Step is kept per group, as upstream's FusedAdam does.
        group["step"] = group.get("step", 0) + 1

    def _launch(
        self, op: Any, device: torch.device, group: dict[str, Any], lists: dict[str, list]
    ) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        bc = bool(group["bias_correction"])
        tensors = (lists["p"], lists["g"], lists["exp_avg"], lists["exp_avg_sq"])
        if device.type == "cuda":
            op.multi_tensor_adam(
                *tensors, lr, beta1, beta2, eps, group["step"], self.adam_w_mode, bc, wd
            )
        else:
            op.adam_step(*tensors, group["step"], lr, beta1, beta2, eps, wd, bc, self.adam_w_mode)
