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
- All momenta go through one batched 1-bit all-reduce (four collectives a step, a scale
  for each chunk of each tensor). Its error-feedback buffers differ by rank: they live
  beside the optimizer's state (which data-parallel rank 0 writes once) and
  per_rank_state_dict() carries them into each rank's own checkpoint file, so a resume at
  the same world size continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepspeed_ext.ops.cpu_optimizer import check_hparams
from deepspeed_ext.runtime.compression import CompressedExchange, SignCodec


class OnebitAdam(torch.optim.Optimizer):
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
        _check(lr, freeze_step, betas, eps, weight_decay, max_grad_norm, amsgrad)
        _check_backend(eps_inside_sqrt, bias_correction, cuda_aware, comm_backend_name)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.comm_backend_name = comm_backend_name
        self.deepspeed: Any = None
        self._onebit: CompressedExchange | None = None
        # the frozen variance's denominators, made at the first compressed step (not state:
        # derived from exp_avg_sq, so a load simply drops them)
        self._denoms: dict[torch.Tensor, torch.Tensor] = {}
        if deepspeed is not None:
            self.attach_engine(deepspeed)

    def attach_engine(self, engine: Any) -> None:
        """Exchange over the engine's data-parallel group, and switch its gradient all-reduce
        off once compression starts (also when resumed past freeze_step)."""
        if engine.zero_optimization_stage() != 0:
            raise ValueError(
                "OnebitAdam runs with zero_optimization.stage 0 only (as upstream): it exchanges "
                "compressed momentum where ZeRO reduces gradients into partitions; set the stage "
                f"to 0 (it is {engine.zero_optimization_stage()})"
            )
        self.deepspeed = engine
        self._onebit = CompressedExchange(SignCodec(), engine.layout.data)
        engine.enable_backward_allreduce = not self.compressing

    @property
    def compressing(self) -> bool:
        return self._steps_done() >= self.freeze_step

    def _steps_done(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    return int(st["step"])
        return 0

    @property
    def exchange(self) -> CompressedExchange:
        """The momenta's 1-bit exchange with its error buffers (this rank's own)."""
        if self._onebit is None:  # used outside an engine: the world is the data-parallel group
            self._onebit = CompressedExchange(SignCodec())
        return self._onebit

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress = self.compressing
        work: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("OnebitAdam does not take sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                grad = p.grad
                if wd != 0:
                    p.mul_(1 - lr * wd)
                st["exp_avg"].lerp_(grad, 1 - beta1)
                if not compress:
                    st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                work.append((p, st, group))
        if compress and work:  # all momenta in the same four collectives
            self.exchange([st["exp_avg"] for _, st, _ in work])
        for p, st, group in work:
            beta1, beta2 = group["betas"]
            step = st["step"]
            step_size = group["lr"] / (1 - beta1**step)
            denom = self._denoms.get(p) if compress else None
            if denom is None:
                bias_correction2 = 1 - beta2 ** (self.freeze_step if compress else step)
                denom = (st["exp_avg_sq"].sqrt() / bias_correction2**0.5).add_(group["eps"])
                if compress:  # the variance is frozen: so is the denominator
                    self._denoms[p] = denom
            p.addcdiv_(st["exp_avg"], denom, value=-step_size)
        if not compress and self.compressing and self.deepspeed is not None:
            self.deepspeed.enable_backward_allreduce = False  # the warm-up ends here
        return loss

    # -- checkpoints: [Note: 1-bit Adam] --
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._denoms = {}  # made again from the loaded variance
        super().load_state_dict(state_dict)

    def per_rank_state_dict(self) -> dict[str, Any]:
        return self.exchange.state_dict()

    def load_per_rank_state_dict(self, state: dict[str, Any] | None) -> bool:
        """The error buffers this rank saved; False (buffers restart at zero) when there are
        none or they were saved at another world size."""
        self._denoms = {}
        ok = self.exchange.load_state_dict(state)
        if self.deepspeed is not None:
            self.deepspeed.enable_backward_allreduce = not self.compressing
        return ok


def _check(
    lr: float,
    freeze_step: int,
    betas: Any,
    eps: float,
    weight_decay: float,
    max_grad_norm: float,
    amsgrad: bool,
) -> None:
    if amsgrad:
        raise ValueError("OnebitAdam: amsgrad=True is not supported (nor upstream); remove it")
    check_hparams("OnebitAdam", lr, None, tuple(betas), weight_decay)
    if not eps > 0:  # it divides the frozen denominator for the whole compressed stage
        raise ValueError(f"OnebitAdam: eps={eps} must be > 0")
    if int(freeze_step) < 0:
        raise ValueError(f"OnebitAdam: freeze_step={freeze_step} must be >= 0")
    if max_grad_norm:
        raise ValueError(
            "OnebitAdam: max_grad_norm is not used by upstream's 1-bit Adam either; clip with "
            "the config's gradient_clipping instead"
        )


def _check_backend(
    eps_inside_sqrt: bool, bias_correction: bool, cuda_aware: bool, comm_backend_name: str
) -> None:
    if eps_inside_sqrt:
        raise ValueError("OnebitAdam: eps_inside_sqrt=True is not built; remove it")
    if not bias_correction:
        raise ValueError(
            "OnebitAdam: bias_correction=False is not built (the warm-up is torch's Adam, "
            "which corrects); remove it"
        )
    if comm_backend_name not in ("nccl", "gloo", "compressed", "hccl"):
        raise ValueError(
            f"OnebitAdam: comm_backend_name={comm_backend_name!r}: the 1-bit all-reduce runs "
            "over the torch.distributed group (nccl, gloo, hccl); the MPI backend is not built"
        )
    if cuda_aware:
        raise ValueError(
            "OnebitAdam: cuda_aware=True is an MPI option and the MPI backend is not built; "
            "remove it (the exchange runs over the torch.distributed group)"
        )
