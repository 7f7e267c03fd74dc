"""FusedLion: multi-tensor Lion. CUDA tensors go through the fused_lion kernel (one launch
for many tensors, [Note: fused lion math]); CPU tensors through the cpu_lion SIMD kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed_ext.op_builder import CPULionBuilder

from ..cpu_optimizer import check_hparams, load_state_dict_keeping_dtypes
from ..light_optimizer import LightOptimizer


class FusedLion(LightOptimizer):
    """Upstream's FusedLion API. The momentum is fp32 for every param dtype, so fp16 and bf16
    params keep a full-precision exp_avg (upstream keeps it in the param dtype)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        check_hparams("FusedLion", lr, None, betas, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.set_grad_none = set_grad_none
        self._ops: dict[str, Any] = {}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _op(self, device_type: str) -> Any:
        if device_type not in self._ops:
            if device_type == "cuda":
                from deepspeed_ext.op_builder.fused_lion import FusedLionBuilder

                self._ops[device_type] = FusedLionBuilder().load()
            elif device_type == "cpu":
                self._ops[device_type] = CPULionBuilder().load()
            else:
                raise ValueError(f"FusedLion: parameters on {device_type} are not supported")
        return self._ops[device_type]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if args or any(v is not None for v in kwargs.values()):
            raise RuntimeError(
                "FusedLion.step() takes only a closure; grads/output_params/scale/grad_norms "
                "were removed upstream too"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_device: dict[torch.device, dict[str, list[torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                lists = by_device.setdefault(p.device, {"p": [], "g": [], "m": []})
                lists["p"].append(p.data)
                # the CPU kernel takes any float grad dtype; the CUDA one its param's or fp32
                ok = (
                    (p.dtype, torch.float32)
                    if p.is_cuda
                    else (torch.float32, torch.bfloat16, torch.float16)
                )
                g = p.grad if p.grad.dtype in ok else p.grad.float()
                lists["g"].append(g.contiguous())
                lists["m"].append(state["exp_avg"])
            for device, lists in by_device.items():
                self._launch(device, group, lists)
        return loss

    def _launch(self, device: torch.device, group: dict[str, Any], lists: dict[str, list]) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        op = self._op(device.type)
        # The kernels need contiguous params; step a contiguous copy and copy it back.
        params = [p if p.is_contiguous() else p.contiguous() for p in lists["p"]]
        if device.type == "cuda":
            op.multi_tensor_lion(params, lists["g"], lists["m"], lr, beta1, beta2, wd)
        else:
            op.lion_step(params, lists["g"], lists["m"], lr, beta1, beta2, wd)
        for dst, src in zip(lists["p"], params):
            if dst is not src:
                dst.copy_(src)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_state_dict_keeping_dtypes(self, state_dict, lambda p: torch.float32)
