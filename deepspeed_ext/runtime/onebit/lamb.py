"""1-bit LAMB (Li et al., 2021): LAMB for a warm-up, then compressed momentum with a frozen
variance and a trust ratio carried over from the warm-up ([Note: compressed all-reduce]).

[Note: 1-bit LAMB]
- Steps 1..freeze_step: this package's LAMB ([Note: lamb math], FusedLamb's torch path, bit
  for bit) on all-reduced gradients. Each step's per-tensor trust ratio c (where both norms
  are non-zero) feeds a running average: lamb_coeff_freeze = coeff_beta * lamb_coeff_freeze
  + (1 - coeff_beta) c. At step freeze_step a second copy of the variance starts, the fresh
  variance.
- After it the variance freezes and the engine stops all-reducing gradients: each rank folds
  its own gradient into its momentum, all momenta are averaged by the 1-bit exchange (each
  tensor's chunks with a scale of their own: upstream scales every momentum to one common
  size to share a scale in one flat buffer, which this makes unnecessary), and the gradient
  the averaged momentum implies, (m - beta1 m_last) / (1 - beta1), updates the fresh
  variance. The trust ratio is lamb_coeff_freeze times a factor: the largest elementwise
  ratio of the frozen denominator to the fresh one (how much larger the steps would be with
  the fresh variance), mixed towards 1 by the weight decay's share of the update, clipped to
  [factor_min, factor_max] and to within factor_threshold of the last step's factor.
- The update is LAMB's: p -= step_size * c * (m / (sqrt(v) + eps) + weight_decay * p), the
  step size carrying the bias corrections as FusedLamb's does (beta2's frozen with v).
- Every rank holds the same momentum and variances; only the error buffers differ (each
  rank's own file). Unlike upstream, a load keeps the trust-ratio state and the fresh
  variance (upstream resets them when the checkpoint is still in its warm-up), so a resume
  continues bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from deepspeed_ext.ops.lamb.fused_lamb import lamb_step_torch

from .base import OneBitOptimizer, check_common, check_steps, zeros


class OnebitLamb(OneBitOptimizer):
    def __init__(
        self,
        params: Iterable[Any],
        deepspeed: Any = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        check_common(
            "OnebitLamb", lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
            eps_inside_sqrt, cuda_aware, comm_backend_name,
        )  # fmt: skip
        check_steps("OnebitLamb", freeze_step=freeze_step)
        _check_coeffs(max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bool(bias_correction),
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.coeff_beta = float(coeff_beta)
        self.factor_max, self.factor_min = float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self.comm_backend_name = comm_backend_name
        self.lamb_coeffs: list[float] = []
        self._denoms = {}
        if deepspeed is not None:
            self.attach_engine(deepspeed)

    @property
    def compressing(self) -> bool:
        return int(self._lead_state().get("step", 0)) >= self.freeze_step

    def allreduce_next(self) -> bool:
        return not self.compressing

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per updated param."""
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compressing

        def init(p: torch.Tensor, st: dict[str, Any]) -> None:
            st.update(lamb_coeff_freeze=0.0, last_factor=1.0)
            zeros(p, st, "exp_avg", "exp_avg_sq")

        # empty tensors have no norm for a trust ratio: kept in the groups (the engine pairs
        # them with the model's), skipped here
        work = [w for w in self._with_grads(init) if w[0].numel() > 0]
        if not work:
            return loss
        coeffs = self._compressed(work) if compress else self._warm_up(work)
        self.lamb_coeffs = torch.stack(coeffs).tolist() if coeffs else []
        if not compress and self.compressing:
            self._switch_allreduce()  # the warm-up ends here
        return loss

    def _warm_up(self, work: list[Any]) -> list[torch.Tensor]:
        coeffs: list[torch.Tensor] = []
        for group in self.param_groups:
            mine = [(p, st) for p, st, g in work if g is group]
            if not mine:
                continue
            beta1, beta2 = group["betas"]
            step = mine[0][1]["step"]
            out = lamb_step_torch(
                [p for p, _ in mine],
                [p.grad for p, _ in mine],
                [st["exp_avg"] for _, st in mine],
                [st["exp_avg_sq"] for _, st in mine],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                eps_inside_sqrt=False,
                weight_decay=group["weight_decay"],
                step_size=_step_size(group, step, step),
                grad_scale=1.0,
                max_coeff=group["max_coeff"],
                min_coeff=group["min_coeff"],
            )
            for (_, st), c in zip(mine, out.tolist()):
                if c != 1.0:  # 1: a norm was zero, no trust ratio to learn from
                    st["lamb_coeff_freeze"] = (
                        self.coeff_beta * st["lamb_coeff_freeze"] + (1 - self.coeff_beta) * c
                    )
                if st["step"] == self.freeze_step:
                    st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
            coeffs.extend(out.unbind())
        return coeffs

    def _first_seen(self, late: list[Any]) -> None:
        """[Note: params first used after the warm-up]: a param first used now has neither
        the warm-up's variance nor its trust ratio (0: it never moved). Both are taken from
        its first gradient averaged over the ranks, as one warm-up step would make them."""
        for (p, st, group), g in self._first_variance(late, "var_steps"):
            st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
            update = g.mul(1 - group["betas"][0]) / st["exp_avg_sq"].sqrt().add_(group["eps"])
            if group["weight_decay"]:
                update.add_(p, alpha=group["weight_decay"])
            w, u = float(p.norm()), float(update.norm())
            ratio = w / u if w > 0 and u > 0 else 1.0
            st["lamb_coeff_freeze"] = min(max(ratio, group["min_coeff"]), group["max_coeff"])

    def _compressed(self, work: list[Any]) -> list[torch.Tensor]:
        self._first_seen(self._unmeasured(work))
        last = [st["exp_avg"].clone() for _, st, _ in work]
        for p, st, group in work:
            st["exp_avg"].lerp_(p.grad, 1 - group["betas"][0])
        self.exchange([st["exp_avg"] for _, st, _ in work])
        coeffs = []
        for (p, st, group), m_last in zip(work, last):
            beta1, beta2 = group["betas"]
            m = st["exp_avg"]
            if "exp_avg_sq_fresh" not in st:  # freeze_step 0: no warm-up made one
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
            fresh = st["exp_avg_sq_fresh"]
            implied = m_last.mul_(-beta1).add_(m).div_(1 - beta1)  # the averaged gradient
            fresh.mul_(beta2).addcmul_(implied, implied, value=1 - beta2)
            denom = st["exp_avg_sq"].sqrt().add_(group["eps"])
            pre = m / denom
            update = pre.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else pre
            factor = (denom / fresh.sqrt().add_(group["eps"])).max()
            if group["weight_decay"]:
                share = (pre.norm() / update.norm()).clamp(max=1.0)
                factor = factor * share + (1 - share)
            factor = factor.clamp(self.factor_min, self.factor_max)
            last_f, thr = st["last_factor"], self.factor_threshold  # a float, then a tensor
            factor = torch.clamp(factor, min=last_f * (1 - thr), max=last_f * (1 + thr))
            st["last_factor"] = factor  # kept on the device: no sync per tensor
            coeff = st["lamb_coeff_freeze"] * factor
            size = _step_size(group, st["step"], st.get("var_steps", self.freeze_step))
            p.add_(update * coeff, alpha=-size)
            coeffs.append(coeff.reshape(()))
        return coeffs


def _step_size(group: dict[str, Any], step: int, variance_steps: int) -> float:
    """FusedLamb's: the bias corrections in the step size ([Note: lamb math])."""
    lr = float(group["lr"])
    if not group["bias_correction"]:
        return lr
    beta1, beta2 = group["betas"]
    return lr * math.sqrt(1.0 - beta2**variance_steps) / (1.0 - beta1**step)


def _check_coeffs(
    max_coeff: float,
    min_coeff: float,
    coeff_beta: float,
    factor_max: float,
    factor_min: float,
    factor_threshold: float,
) -> None:
    if not 0 < min_coeff <= max_coeff:
        raise ValueError(
            f"OnebitLamb: min_coeff={min_coeff}, max_coeff={max_coeff}: expected "
            "0 < min_coeff <= max_coeff"
        )
    if not 0 <= coeff_beta < 1:
        raise ValueError(f"OnebitLamb: coeff_beta={coeff_beta}: expected a value in [0, 1)")
    if not 0 < factor_min <= 1 <= factor_max:
        raise ValueError(
            f"OnebitLamb: factor_min={factor_min}, factor_max={factor_max}: expected "
            "0 < factor_min <= 1 <= factor_max"
        )
    if not 0 <= factor_threshold < 1:
        raise ValueError(
            f"OnebitLamb: factor_threshold={factor_threshold}: expected a value in [0, 1)"
        )
