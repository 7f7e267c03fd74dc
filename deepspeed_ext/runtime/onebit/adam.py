"""1-bit Adam (Tang et al., 2021): Adam for a warm-up, then a frozen variance and momentum
exchanged as signs ([Note: compressed all-reduce]).

[Note: 1-bit Adam]
- Steps 1..freeze_step: exactly torch.optim.AdamW (decoupled weight decay, as upstream's
  1-bit Adam and DeepSpeed's "Adam" decay; bias correction; the same operations in the same
  order, so the same bits), on gradients the engine all-reduced.
- At the end of step freeze_step the variance freezes and the engine stops all-reducing
  gradients (`engine.enable_backward_allreduce = False`): from then on each rank folds its own
  gradient into its momentum, m = beta1 m + (1 - beta1) g, and the momentum is averaged over
  the data-parallel group by the 1-bit all-reduce with error feedback. Every rank then holds
  the same momentum, so the same update: p -= lr / (1 - beta1^t) * m / (sqrt(v / (1 -
  beta2^freeze_step)) + eps), the variance's bias correction frozen with it.
- All momenta go through one batched 1-bit all-reduce (two collectives a step, a scale
  for each chunk of each tensor). Its error-feedback buffers differ by rank: they live
  beside the optimizer's state (which data-parallel rank 0 writes once) and
  per_rank_state_dict() carries them into each rank's own checkpoint file, so a resume at
  the same world size continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .base import OneBitOptimizer, adamw_denom, check_common, check_steps, zeros


class OnebitAdam(OneBitOptimizer):
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
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        check_common(
            "OnebitAdam", lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
            eps_inside_sqrt, cuda_aware, comm_backend_name,
        )  # fmt: skip
        check_steps("OnebitAdam", freeze_step=freeze_step)
        if not bias_correction:
            raise ValueError(
                "OnebitAdam: bias_correction=False is not built (the warm-up is torch's Adam, "
                "which corrects); remove it"
            )
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.comm_backend_name = comm_backend_name
        self._denoms = {}
        if deepspeed is not None:
            self.attach_engine(deepspeed)

    @property
    def compressing(self) -> bool:
        return int(self._lead_state().get("step", 0)) >= self.freeze_step

    def allreduce_next(self) -> bool:
        return not self.compressing

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compressing
        work = self._with_grads(lambda p, st: zeros(p, st, "exp_avg", "exp_avg_sq"))
        if compress:  # [Note: params first used after the warm-up]
            self._first_variance(self._unmeasured(work), "var_steps")
        for p, st, group in work:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            grad = p.grad
            if wd != 0:
                p.mul_(1 - lr * wd)
            st["exp_avg"].lerp_(grad, 1 - beta1)
            if not compress:
                st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                st["var_steps"] = st["step"]  # torch's correction: this param's own steps
        if compress and work:  # all momenta in the same two collectives
            self.exchange([st["exp_avg"] for _, st, _ in work])
        for p, st, group in work:
            beta1, beta2 = group["betas"]
            step = st["step"]
            step_size = group["lr"] / (1 - beta1**step)
            denom = self._denoms.get(p) if compress else None
            if denom is None:
                k = st.get("var_steps", self.freeze_step)  # absent: saved before it was kept
                denom = adamw_denom(st["exp_avg_sq"], beta2, k, group["eps"])
                if compress:  # the variance is frozen: so is the denominator
                    self._denoms[p] = denom
            p.addcdiv_(st["exp_avg"], denom, value=-step_size)
        if not compress and self.compressing:
            self._switch_allreduce()  # the warm-up ends here
        return loss
