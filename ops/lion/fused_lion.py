"""FusedLion: multi-tensor Lion. CUDA tensors go through the fused_lion kernel (one launch
for many tensors, [Note: fused lion math]); CPU tensors through the cpu_lion SIMD kernel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepspeed_ext.op_builder import CPULionBuilder

from ..cpu_optimizer import check_hparams
from ..fused_optimizer import FusedOptimizer


class FusedLion(FusedOptimizer):
    """Upstream's FusedLion API. The momentum is fp32 for every param dtype, so fp16 and bf16
    params keep a full-precision exp_avg (upstream keeps it in the param dtype)."""

    NAME = "FusedLion"
    STATE_KEYS = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        check_hparams("FusedLion", lr, None, betas, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), set_grad_none)

    def _builder(self, device_type: str) -> Any:
        if device_type == "cuda":
            from deepspeed_ext.op_builder.fused_lion import FusedLionBuilder

            return FusedLionBuilder
        return CPULionBuilder if device_type == "cpu" else None

    def _launch(
        self, op: Any, device: torch.device, group: dict[str, Any], lists: dict[str, list]
    ) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        fn = op.multi_tensor_lion if device.type == "cuda" else op.lion_step
        fn(lists["p"], lists["g"], lists["exp_avg"], lr, beta1, beta2, wd)
