"""0/1 Adam (Lu et al., 2022): Adam whose variance updates thin out, then 1-bit
synchronisation of local steps ([Note: compressed all-reduce]).

[Note: 0/1 Adam]
Steps t = 1, 2, ... (each rank runs the same schedule; the counters live in every param's
state, as upstream's, so a checkpoint carries them):
- Variance phase, t <= var_freeze_step. On a variance step (t % var_interval == 0) the
  engine all-reduced the gradients in full precision: m and v take g (Adam). On the other
  steps the engine left each rank its own gradient and the gradients are averaged by the
  1-bit exchange with error feedback: m takes that mean, v stays. Every var_update_scaler
  variance steps var_interval doubles (1, 1, ..., 2, 2, ..., 4, ...), so the full-precision
  all-reduces thin out. The update is AdamW's: p -= lr * wd * p, then
  p -= lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^k)) + eps), k the number of variance
  updates so far (bias_correction=False drops both corrections, as upstream's numerics).
  With var_update_scaler > t every step so far was a variance step: torch's AdamW bit for
  bit.
- Local phase, t > var_freeze_step: the variance (and its denominator) is frozen, the engine
  never all-reduces, and each rank steps on its own gradient, away from an anchor (the
  params at the last synchronisation, the same on every rank, kept in the state). Every
  local_step_interval steps the ranks synchronise: u = p - anchor in gradient units
  (u * denom, the lr-weighted sum of update directions) is averaged by the 1-bit exchange,
  p becomes anchor + mean / denom, the momentum becomes the lr-weighted mean direction
  (-mean / the sum of lr since the last sync, times 1 - beta1^t with bias correction).
  Upstream keeps u as an accumulator and subtracts it back, which leaves the ranks a
  rounding apart; from the kept anchor they land on the same bits. Every local_step_scaler
  local steps the interval doubles, up to local_step_clipper.
- The error buffers restart at zero when the local phase begins (the quantity exchanged
  changes from gradients to accumulated updates).
Between synchronisations the ranks' params, momenta and accumulators differ: each rank's
go to its own checkpoint file with its error buffers, so a resume anywhere continues bit for
bit. Unlike upstream, no step is spent on initialisation (upstream's first step discards its
gradient) and a load keeps the schedule's counters (upstream's resets them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .base import OneBitOptimizer, adamw_denom, check_common, check_steps, zeros

_COUNTERS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter")


class ZeroOneAdam(OneBitOptimizer):
    def __init__(
        self,
        params: Iterable[Any],
        deepspeed: Any = None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        check_common(
            "ZeroOneAdam", lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
            eps_inside_sqrt, cuda_aware, comm_backend_name,
        )  # fmt: skip
        check_steps("ZeroOneAdam", var_freeze_step=var_freeze_step)
        check_steps(
            "ZeroOneAdam",
            "",
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bool(bias_correction),
        )
        super().__init__(params, defaults)
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self.comm_backend_name = comm_backend_name
        self._denoms = {}
        if deepspeed is not None:
            self.attach_engine(deepspeed)

    # -- the schedule, read from the state that counted the most steps (_lead_state) --
    def _schedule(self) -> dict[str, Any]:
        st = self._lead_state()
        return {
            "step": int(st.get("step", 0)),
            "var_interval": int(st.get("var_interval", 1)),
            "local_step_interval": int(st.get("local_step_interval", 1)),
        }

    def allreduce_next(self) -> bool:
        s = self._schedule()
        nxt = s["step"] + 1
        return nxt <= self.var_freeze_step and nxt % s["var_interval"] == 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._advance()
        if not work:
            return loss
        lead = self._lead_state()  # its counters: a param first used late has its own
        t = int(lead["step"])
        if t <= self.var_freeze_step:
            self._variance_phase(work, t, lead)
        else:
            self._local_phase(work, t, lead)
        self._count(work, t, lead)
        self._switch_allreduce()
        return loss

    def _advance(self) -> list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]:
        def init(p: torch.Tensor, st: dict[str, Any]) -> None:
            st.update(var_updates=0, lrs=0.0, var_interval=1, var_counter=0)
            st.update(local_step_interval=1, local_step_counter=0)
            zeros(p, st, "exp_avg", "exp_avg_sq")

        return self._with_grads(init)

    def _variance_phase(self, work: list[Any], t: int, lead: dict[str, Any]) -> None:
        full = t % lead["var_interval"] == 0
        if not full:  # [Note: params first used after the warm-up]
            self._first_variance(self._unmeasured(work), "var_updates")
        grads = [p.grad for p, _, _ in work]
        if not full:  # each rank's own gradient: their 1-bit mean instead
            grads = [g.detach().clone() for g in grads]
            self.exchange(grads)
        for (p, st, group), g in zip(work, grads):
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            if wd != 0:
                p.mul_(1 - lr * wd)
            st["exp_avg"].lerp_(g, 1 - beta1)
            if full:
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                st["var_updates"] += 1
            p.addcdiv_(st["exp_avg"], self._denom(st, group), value=-self._step_size(st, group))

    def _local_phase(self, work: list[Any], t: int, lead: dict[str, Any]) -> None:
        if t == self.var_freeze_step + 1:  # the exchanged quantity changes: fresh errors
            self.exchange.load_state_dict(None)
            self._denoms = {}
        # [Note: params first used after the warm-up]
        self._first_variance(self._unmeasured(work), "var_updates")
        for p, st, group in work:
            if "anchor" not in st:  # the params every rank shares until the next sync
                st["anchor"] = p.detach().clone()
            beta1 = group["betas"][0]
            lr, wd = group["lr"], group["weight_decay"]
            st["exp_avg"].lerp_(p.grad, 1 - beta1)
            st["lrs"] += lr
            if wd != 0:
                p.mul_(1 - lr * wd)
            denom = self._frozen_denom(p, st, group)
            p.addcdiv_(st["exp_avg"], denom, value=-self._step_size(st, group))
        if t % lead["local_step_interval"]:
            return
        # the local updates since the anchor, in gradient units, averaged over the ranks
        moved = [(p - st["anchor"]).mul_(self._frozen_denom(p, st, group)) for p, st, group in work]
        self.exchange(moved)
        for (p, st, group), u in zip(work, moved):
            corr = (1 - group["betas"][0] ** t) if group["bias_correction"] else 1.0
            if st["lrs"] > 0:  # at lr 0 nothing moved to recover it from: it stays local
                st["exp_avg"].copy_(u).mul_(-corr / st["lrs"])
            # from the shared anchor: every rank lands on the same params
            torch.addcdiv(st["anchor"], u, self._frozen_denom(p, st, group), out=p)
            st["anchor"].copy_(p)
            st["lrs"] = 0.0

    def _count(self, work: list[Any], t: int, lead: dict[str, Any]) -> None:
        """The schedule's counters, the same in every param's state."""
        c = {k: lead[k] for k in _COUNTERS}
        if t <= self.var_freeze_step:
            if t % c["var_interval"] == 0:
                c["var_counter"] += 1
                if c["var_counter"] == self.var_update_scaler:
                    c["var_counter"] = 0
                    c["var_interval"] *= 2
        else:
            c["local_step_counter"] += 1
            if c["local_step_counter"] == self.local_step_scaler:
                c["local_step_counter"] = 0
                c["local_step_interval"] = min(
                    self.local_step_clipper, 2 * c["local_step_interval"]
                )
        for _, st, _ in work:
            st.update(c)

    # -- the update's pieces, in torch AdamW's order of operations --
    @staticmethod
    def _step_size(st: dict[str, Any], group: dict[str, Any]) -> float:
        if not group["bias_correction"]:
            return group["lr"]
        return group["lr"] / (1 - group["betas"][0] ** st["step"])

    @staticmethod
    def _denom(st: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        k = st["var_updates"] if group["bias_correction"] else 0
        return adamw_denom(st["exp_avg_sq"], group["betas"][1], k, group["eps"])

    def _frozen_denom(self, p: torch.Tensor, st: dict[str, Any], group: Any) -> torch.Tensor:
        if p not in self._denoms:
            self._denoms[p] = self._denom(st, group)
        return self._denoms[p]

    # -- checkpoints: [Note: 0/1 Adam] --
    def per_rank_state_dict(self) -> dict[str, Any]:
        """Besides the error buffers, what local steps made differ by rank."""
        own = super().per_rank_state_dict()
        if self._schedule()["step"] > self.var_freeze_step:
            own["local"] = [
                {"param": p.detach().clone(), "exp_avg": st["exp_avg"]}
                for group in self.param_groups
                for p in group["params"]
                if (st := self.state.get(p))
            ]
        return own

    @torch.no_grad()
    def load_per_rank_state_dict(self, state: dict[str, Any] | None) -> bool:
        ok = super().load_per_rank_state_dict(state)
        local = (state or {}).get("local") if ok else None
        if local is not None:
            mine = [p for g in self.param_groups for p in g["params"] if self.state.get(p)]
            for p, saved in zip(mine, local, strict=True):
                p.copy_(saved["param"])
                self.state[p]["exp_avg"].copy_(saved["exp_avg"])
        return ok
