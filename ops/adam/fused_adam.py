"""FusedAdam: multi-tensor Adam/AdamW. CUDA tensors go through the fused_adam kernel
(one launch for many tensors); CPU tensors through the cpu_adam SIMD kernel, as upstream
does on its CPU accelerator."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed_ext.op_builder import CPUAdamBuilder

from ..cpu_optimizer import check_hparams, load_state_dict_keeping_dtypes
from ..light_optimizer import LightOptimizer


class FusedAdam(LightOptimizer):
    """Upstream's FusedAdam API. Optimizer states are fp32 for every param dtype, so fp16
    and bf16 params keep full-precision moments (upstream keeps them in the param dtype)."""

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
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self._ops: dict[str, Any] = {}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _op(self, device_type: str) -> Any:
        if device_type not in self._ops:
            if device_type == "cuda":
                from deepspeed_ext.op_builder.fused_adam import FusedAdamBuilder

                self._ops[device_type] = FusedAdamBuilder().load()
            elif device_type == "cpu":
                self._ops[device_type] = CPUAdamBuilder().load()
            else:
                raise ValueError(f"FusedAdam: parameters on {device_type} are not supported")
        return self._ops[device_type]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if args or any(v is not None for v in kwargs.values()):
            raise RuntimeError(
                "FusedAdam.step() takes only a closure; grads/output_params/scale/grad_norms "
                "were removed upstream too"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not any(p.grad is not None for p in group["params"]):
                continue
            # Step is kept per group, as upstream's FusedAdam does.
            group["step"] = group.get("step", 0) + 1
            by_device: dict[torch.device, dict[str, list[torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                lists = by_device.setdefault(p.device, {"p": [], "g": [], "m": [], "v": []})
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
                lists["v"].append(state["exp_avg_sq"])
            for device, lists in by_device.items():
                self._launch(device, group, lists)
        return loss

    def _launch(self, device: torch.device, group: dict[str, Any], lists: dict[str, list]) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        bc = bool(group["bias_correction"])
        op = self._op(device.type)
        # The kernels need contiguous params; step a contiguous copy and copy it back.
        params = [p if p.is_contiguous() else p.contiguous() for p in lists["p"]]
        if device.type == "cuda":
            op.multi_tensor_adam(
                params,
                lists["g"],
                lists["m"],
                lists["v"],
                lr,
                beta1,
                beta2,
                eps,
                group["step"],
                self.adam_w_mode,
                bc,
                wd,
            )
        else:
            op.adam_step(
                params,
                lists["g"],
                lists["m"],
                lists["v"],
                group["step"],
                lr,
                beta1,
                beta2,
                eps,
                wd,
                bc,
                self.adam_w_mode,
            )
        for dst, src in zip(lists["p"], params):
            if dst is not src:
                dst.copy_(src)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_state_dict_keeping_dtypes(self, state_dict, lambda p: torch.float32)
