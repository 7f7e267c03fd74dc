"""FusedLamb: upstream DeepSpeed's LAMB optimizer, with its constructor and step() API.

The math is pinned in [Note: lamb math] (csrc/fused_lamb/fused_lamb.h). Contiguous
fp32/fp16/bf16 params on CUDA, with grads in fp32 or the param dtype (or fp16/bf16 grads
for fp32 params), go through the fused kernel (torch.ops.ds_fused_lamb.multi_tensor_lamb);
anything else (CPU, float64, ...) through lamb_step_torch, the same math in torch ops.

Where this differs from upstream (on purpose):
  - Optimizer states are fp32 for every param dtype (float64 for float64 params); upstream
    keeps them in the param dtype. They stay fp32 across load_state_dict.
  - A single grad norm given for a group applies to every param of the group; upstream
    zips it against the params and so updates only the first param.
  - max_grad_norm > 0 without grad_norms: the group's grad norm is computed here; upstream
    fails with a TypeError.
  - Bad hyperparameters raise ValueError in the constructor.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from deepspeed_ext.op_builder.fused_lamb import FusedLambBuilder

from ..cpu_optimizer import check_hparams, load_state_dict_keeping_dtypes
from ..light_optimizer import LightOptimizer

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lamb_step_torch(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    eps_inside_sqrt: bool,
    weight_decay: float,
    step_size: float,
    grad_scale: float,
    max_coeff: float,
    min_coeff: float,
) -> torch.Tensor:
    """One LAMB step of [Note: lamb math] on lists of same-dtype, same-device tensors.

    Updates params and the moments in place and returns the per-tensor trust ratios. The
    moments' dtype is the working precision; params of another dtype are updated through a
    copy in it and rounded once.
    """
    work = exp_avgs[0].dtype
    p_work = [p if p.dtype == work else p.to(work) for p in params]
    g = [x.to(work) for x in grads]
    if grad_scale != 1.0:
        g = list(torch._foreach_div(g, grad_scale))

    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, g, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1.0 - beta2)

    if eps_inside_sqrt:
        denom = torch._foreach_sqrt(torch._foreach_add(exp_avg_sqs, eps))
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, denom)
    if weight_decay != 0.0:
        torch._foreach_add_(update, p_work, alpha=weight_decay)

    w_norm = torch.stack(torch._foreach_norm(p_work))
    u_norm = torch.stack(torch._foreach_norm(update))
    # `!= 0` rather than `> 0`: a NaN norm must give a NaN coeff, as the kernel does.
    ratio = (w_norm / u_norm).clamp(min=min_coeff, max=max_coeff)
    coeffs = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))

    torch._foreach_mul_(update, list((coeffs * -step_size).unbind()))
    torch._foreach_add_(p_work, update)
    for p, pw in zip(params, p_work):
        if pw is not p:
            p.copy_(pw)
    return coeffs


def _per_group(values: Any, n_groups: int) -> list[Any]:
    """Upstream's convention: None, one flat list (a single group), or a list per group."""
    if values is None:
        return [None] * n_groups
    if isinstance(values, types.GeneratorType):
        return [list(values)]
    values = list(values)
    if values and not isinstance(values[0], (list, tuple)):
        return [values]
    return values


class FusedLamb(LightOptimizer):
    """LAMB (https://arxiv.org/abs/1904.00962) as upstream DeepSpeed computes it.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        bias_correction: fold 1 - beta^t corrections into the step size.
        betas: moment decay rates.
        eps: added to sqrt(v) (or to v with eps_inside_sqrt) in the denominator.
        eps_inside_sqrt: sqrt(v + eps) instead of sqrt(v) + eps.
        weight_decay: added to the update as weight_decay * p, before the trust ratio.
        max_grad_norm: if > 0, grads whose norm exceeds it are scaled down (see step()).
        max_coeff, min_coeff: clamp of the per-tensor trust ratio.
        amsgrad: not supported (raises RuntimeError, as upstream).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1  # upstream's name: 0 = eps inside sqrt
        self.lamb_coeffs: list[torch.Tensor] = []  # 0-d trust ratios of the last step
        self._op: Any = None  # torch.ops.ds_fused_lamb, loaded on the first CUDA step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float = 1.0,
        grad_norms: Sequence[Any] | None = None,
    ) -> Any:
        """One LAMB step.

        grads: grads to use instead of p.grad (a flat list for one group, or a list per group).
        output_params: tensors (same layout) that receive a copy of the updated params.
        scale: the loss scale; grads are divided by it.
        grad_norms: per group, the norm of the still-scaled grads (one number for the group
            or one per param), used with max_grad_norm: clip = (norm / scale + 1e-6) /
            max_grad_norm, and grads are divided by clip * scale when clip > 1.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self.param_groups)
        norms = list(grad_norms) if grad_norms is not None else [None] * n
        self.lamb_coeffs.clear()
        for group, g_list, o_list, norm in zip(
            self.param_groups, _per_group(grads, n), _per_group(output_params, n), norms
        ):
            self.lamb_coeffs.extend(self._step_group(group, g_list, o_list, norm, float(scale)))
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per updated param, in param order."""
        if not self.lamb_coeffs:
            return []
        return torch.stack(self.lamb_coeffs).tolist()  # one device sync for all

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_state_dict_keeping_dtypes(self, state_dict, _state_dtype)

    # -- internals ---------------------------------------------------------------------------
    def _step_group(
        self, group: dict[str, Any], g_list: Any, o_list: Any, norm: Any, scale: float
    ) -> list[torch.Tensor]:
        params: list[torch.Tensor] = group["params"]
        g_list = _as_list(g_list, len(params), "grads")
        o_list = _as_list(o_list, len(params), "output_params")
        norms = _norms_per_param(group, params, g_list, norm)
        items = []  # (param, grad, output param, divisor of the grad)
        for p, g, out, n in zip(params, g_list, o_list, norms):
            g = p.grad if g is None else g
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("FusedLamb does not support sparse gradients")
            items.append((p, g, out, _combined_scale(group, n, scale)))
        if not items:
            return []

        beta1, beta2 = (float(b) for b in group["betas"])
        # Bucket by everything one op call shares; normally one bucket per group.
        buckets: dict[tuple[Any, ...], list[int]] = {}
        for i, (p, g, _, grad_scale) in enumerate(items):
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros(p.shape, dtype=_state_dtype(p), device=p.device)
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            state["step"] += 1
            fused = (
                p.device.type == "cuda"
                and p.dtype in _KERNEL_DTYPES
                and p.is_contiguous()
                and (g.dtype in (p.dtype, torch.float32) or p.dtype == torch.float32)
                and g.dtype in _KERNEL_DTYPES
            )
            key = (fused, p.device, p.dtype, g.dtype, state["step"], grad_scale)
            buckets.setdefault(key, []).append(i)

        coeffs: list[torch.Tensor | None] = [None] * len(items)
        for (fused, _, _, _, step, grad_scale), idx in buckets.items():
            ps = [items[i][0] for i in idx]
            gs = [items[i][1].contiguous() for i in idx]
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            if fused:
                if self._op is None:
                    self._op = FusedLambBuilder().load()
                out = self._op.multi_tensor_lamb(
                    [p.data for p in ps],
                    gs,
                    ms,
                    vs,
                    float(group["lr"]),
                    beta1,
                    beta2,
                    float(group["eps"]),
                    step,
                    bool(group["bias_correction"]),
                    float(group["weight_decay"]),
                    self.eps_mode == 0,
                    grad_scale,
                    float(group["max_coeff"]),
                    float(group["min_coeff"]),
                )
            else:
                out = lamb_step_torch(
                    [p.data for p in ps],
                    gs,
                    ms,
                    vs,
                    beta1=beta1,
                    beta2=beta2,
                    eps=float(group["eps"]),
                    eps_inside_sqrt=self.eps_mode == 0,
                    weight_decay=float(group["weight_decay"]),
                    step_size=_step_size(group, beta1, beta2, step),
                    grad_scale=grad_scale,
                    max_coeff=float(group["max_coeff"]),
                    min_coeff=float(group["min_coeff"]),
                )
            for j, i in enumerate(idx):
                coeffs[i] = out[j]

        for p, _, dst, _ in items:
            if dst is not None:
                dst.copy_(p.data)
        return [c for c in coeffs if c is not None]


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _step_size(group: dict[str, Any], beta1: float, beta2: float, step: int) -> float:
    lr = float(group["lr"])
    if not group["bias_correction"]:
        return lr
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def _as_list(values: Any, n: int, name: str) -> list[Any]:
    if values is None:
        return [None] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"FusedLamb.step: {name} has {len(values)} entries for {n} params")
    return values


def _norms_per_param(
    group: dict[str, Any], params: list[torch.Tensor], grads: list[Any], norm: Any
) -> list[Any]:
    """The grad norm each param's clipping uses (None without max_grad_norm)."""
    if float(group["max_grad_norm"]) <= 0:
        return [None] * len(params)
    if isinstance(norm, (list, tuple)):
        if len(norm) != len(params):
            raise ValueError(f"FusedLamb.step: {len(norm)} grad norms for {len(params)} params")
        return list(norm)
    if norm is None:  # the norm of the group's still-scaled grads, as a caller would pass
        gs: list[torch.Tensor] = [
            x for x in (p.grad if g is None else g for p, g in zip(params, grads)) if x is not None
        ]
        if not gs:
            return [None] * len(params)
        dev = gs[0].device
        parts = [torch.linalg.vector_norm(g, dtype=torch.float32).to(dev) for g in gs]
        norm = float(torch.linalg.vector_norm(torch.stack(parts)))  # one sync per group
    return [norm] * len(params)


def _combined_scale(group: dict[str, Any], norm: Any, scale: float) -> float:
    """The divisor of the grads in [Note: lamb math]: the loss scale, raised to clip."""
    max_norm = float(group["max_grad_norm"])
    if max_norm <= 0 or norm is None:
        return scale
    clip = (float(norm) / scale + 1e-6) / max_norm
    return clip * scale if clip > 1 else scale


def _check_group(group: dict[str, Any]) -> None:
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"FusedLamb: betas must be a pair, got {betas!r}")
    check_hparams("FusedLamb", group["lr"], group["eps"], tuple(betas), group["weight_decay"])
    if not group["max_grad_norm"] >= 0.0:
        raise ValueError(
            f"FusedLamb: invalid max_grad_norm={group['max_grad_norm']} (must be >= 0)"
        )
    lo, hi = group["min_coeff"], group["max_coeff"]
    if not (0.0 <= lo <= hi and math.isfinite(hi)):
        raise ValueError(
            f"FusedLamb: invalid min_coeff={lo}, max_coeff={hi} "
            "(need 0 <= min_coeff <= max_coeff < inf)"
        )
