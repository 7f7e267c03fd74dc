"""What the 1-bit optimizers share: the engine they switch the gradient all-reduce of, the
compressed exchange over its data-parallel group (signs, [Note: compressed all-reduce]) whose
error buffers are this rank's own, and the checks of upstream's shared parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.comm.layout import resolve
from deepspeed_ext.ops.cpu_optimizer import check_hparams
from deepspeed_ext.ops.light_optimizer import LightOptimizer
from deepspeed_ext.runtime.compression import CompressedExchange, SignCodec
from deepspeed_ext.utils.logging import logger


class OneBitOptimizer(LightOptimizer):
    deepspeed: Any = None
    _onebit: CompressedExchange | None = None
    # frozen variances' denominators, made at their first use (not state: derived from
    # exp_avg_sq, so a load simply drops them)
    _denoms: dict[torch.Tensor, torch.Tensor]

    def attach_engine(self, engine: Any) -> None:
        """Exchange over the engine's data-parallel group; the engine's gradient all-reduce
        follows allreduce_next() from now on (also when resumed)."""
        if engine.zero_optimization_stage() != 0:
            raise ValueError(
                f"{type(self).__name__} runs with zero_optimization.stage 0 only (as upstream): "
                "it exchanges compressed state where ZeRO reduces gradients into partitions; "
                f"set the stage to 0 (it is {engine.zero_optimization_stage()})"
            )
        self.deepspeed = engine
        self._onebit = CompressedExchange(SignCodec(), engine.layout.data)
        self._switch_allreduce()

    def allreduce_next(self) -> bool:
        """Whether the next step wants all-reduced gradients (else each rank's own)."""
        raise NotImplementedError  # each optimizer's schedule

    def _switch_allreduce(self) -> None:
        if self.deepspeed is not None:
            self.deepspeed.enable_backward_allreduce = self.allreduce_next()

    @property
    def exchange(self) -> CompressedExchange:
        """The 1-bit exchange with its error buffers (this rank's own)."""
        if self._onebit is None:  # used outside an engine: the world is the data-parallel group
            self._onebit = CompressedExchange(SignCodec())
        return self._onebit

    def _with_grads(
        self, init: Callable[[torch.Tensor, dict[str, Any]], None]
    ) -> list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]:
        """(param, state, group) of every param with a gradient, its state made by `init`
        on first use and its step counted."""
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not take sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    init(p, st)
                st["step"] += 1
                work.append((p, st, group))
        return work

    def _lead_state(self) -> dict[str, Any]:
        """The state that has counted the most steps: the schedule's clock. A param with no
        gradient at some step counts fewer, and one first used late (a branch, an expert, a
        layer unfrozen) starts at 1: read from it, the schedule went back to the warm-up."""
        lead: dict[str, Any] = {}
        for st in self.state.values():
            if st and int(st.get("step", 0)) > int(lead.get("step", 0)):
                lead = st
        return lead

    # [Note: params first used after the warm-up]
    # The frozen variance is measured in the warm-up. A param with no gradient there (a
    # branch, an expert or a head first used later, a layer unfrozen; the engine hands
    # unused params zero gradients) has a variance of zeros, and once it gets a gradient
    # every update was lr * m / eps (upstream's too): weights jumped by 1e4 in a step. Such
    # a param's first non-zero gradient, averaged over the ranks uncompressed (one all-reduce
    # of those params alone, each step until it comes), stands in for its variance, as one
    # Adam variance step would (bias-corrected by 1 step), and the params are named once.
    # Checked once per param (one host sync for all), then only while a param stays unmeasured.
    def _unmeasured(self, work: list[Any]) -> list[Any]:
        """The (param, state, group) items of work whose variance is all zeros."""
        todo = [w for w in work if not w[1].get("measured")]
        if not todo:
            return []
        seen = torch.stack([st["exp_avg_sq"].any() for _, st, _ in todo]).tolist()
        for (_, st, _), s in zip(todo, seen):
            st["measured"] = s
        self._fill_unseen([w for w, s in zip(todo, seen) if s])
        return [w for w, s in zip(todo, seen) if not s]

    # [Note: elements unseen in the warm-up]
    # Within a measured param, elements whose gradient was zero on every rank through the
    # warm-up (embedding rows of tokens not yet seen) have a variance of exactly 0. After the
    # freeze, the 1-bit codec gives every element a sign, zeros too, so their momentum turns
    # non-zero at once and each update was lr * m / eps (upstream's too): those rows jumped
    # by ~1e4 at the first compressed step. Their variance is set once, when the param is
    # first checked after the warm-up, to the mean of its measured elements': a gradient of
    # the param's typical size moves them by about lr, as it moves the others. The variance
    # is the same on every rank (the warm-up averaged its gradients), so the fill is too.
    def _fill_unseen(self, items: list[Any]) -> None:
        if not items:
            return
        zeros = torch.stack([(st["exp_avg_sq"] == 0).sum() for _, st, _ in items]).tolist()
        named = []
        for (p, st, _), z in zip(items, zeros):
            if not z:
                continue
            v = st["exp_avg_sq"]
            unseen = v == 0
            mean = v[~unseen].mean()
            v.masked_fill_(unseen, mean)
            fresh = st.get("exp_avg_sq_fresh")  # 1-bit LAMB's: else its factor, frozen over
            if fresh is not None:  # fresh variance, saw those elements' ratio as unbounded
                fresh.masked_fill_(unseen & (fresh == 0), mean)
            self._denoms.pop(p, None)
            named.append((p, z, v.numel()))
        if named:
            names = self._names([p for p, _, _ in named])
            counts = ", ".join(f"{n} ({z} of {k})" for n, (_, z, k) in zip(names, named))
            logger.warning(
                f"{type(self).__name__}: elements with no gradient before the warm-up ended "
                f"get their param's mean variance: {counts}"
            )

    def _first_variance(self, late: list[Any], counter: str) -> list[Any]:
        """For each unmeasured item whose mean gradient is non-zero: its variance from it,
        counted as 1 variance step in state[counter]. Those items and their mean gradients
        ([Note: params first used after the warm-up])."""
        if not late:
            return []
        group = self.deepspeed.layout.data if self.deepspeed is not None else None
        grads = [p.grad.detach().reshape(-1).float() for p, _, _ in late]
        flat = torch.cat(grads)
        comm.all_reduce(flat, group=group)
        flat /= resolve(group)[1]
        means = [
            v.view(p.shape) for v, (p, _, _) in zip(flat.split([g.numel() for g in grads]), late)
        ]
        got = torch.stack([g.any() for g in means]).tolist()
        out = []
        for item, g, ok in zip(late, means, got):
            if not ok:  # no gradient anywhere yet: its momentum is 0, and so its update
                continue
            p, st, grp = item
            st["exp_avg_sq"].addcmul_(g, g, value=1 - grp["betas"][1])
            st[counter] = 1
            st["measured"] = True
            self._denoms.pop(p, None)
            out.append((item, g))
        self._fill_unseen([item for item, _ in out])
        if out:
            names = self._names([p for (p, _, _), _ in out])
            logger.warning(
                f"{type(self).__name__}: {', '.join(names)} got a first gradient after the "
                "warm-up (freeze step), which measures the variance: theirs is taken from "
                "that gradient averaged over the ranks"
            )
        return out

    def _names(self, params: list[torch.Tensor]) -> list[str]:
        module = getattr(self.deepspeed, "module", None)
        known = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        return [known.get(id(p), f"a param of shape {tuple(p.shape)}") for p in params]

    # -- checkpoints: the optimizer state is written once (data-parallel rank 0); what
    # differs by rank goes to each rank's own file --
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._denoms = {}
        super().load_state_dict(state_dict)
        self._switch_allreduce()

    def per_rank_state_dict(self) -> dict[str, Any]:
        return {"errors": self.exchange.state_dict()}

    def load_per_rank_state_dict(self, state: dict[str, Any] | None) -> bool:
        """This rank's own state; False (error buffers restart at zero) when none was saved
        at this world size."""
        self._denoms = {}
        ok = self.exchange.load_state_dict((state or {}).get("errors"))
        self._switch_allreduce()
        return ok


def adamw_denom(exp_avg_sq: torch.Tensor, beta2: float, steps: int, eps: float) -> torch.Tensor:
    """torch AdamW's denominator in its order of operations (so its bits):
    sqrt(v) / sqrt(1 - beta2^steps) + eps, with `steps` variance updates (0: uncorrected)."""
    if steps == 0:
        return exp_avg_sq.sqrt().add_(eps)
    return (exp_avg_sq.sqrt() / (1 - beta2**steps) ** 0.5).add_(eps)


def zeros(p: torch.Tensor, st: dict[str, Any], *keys: str) -> None:
    for key in keys:
        st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def check_common(
    name: str,
    lr: float,
    betas: Any,
    eps: float,
    weight_decay: float,
    max_grad_norm: float,
    amsgrad: bool,
    eps_inside_sqrt: bool,
    cuda_aware: bool,
    comm_backend_name: str,
) -> None:
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (nor upstream); remove it")
    check_hparams(name, lr, None, tuple(betas), weight_decay)
    if not eps > 0:  # it divides the frozen denominator for the whole compressed stage
        raise ValueError(f"{name}: eps={eps} must be > 0")
    if max_grad_norm:
        raise ValueError(
            f"{name}: max_grad_norm is not used by upstream's 1-bit optimizers either; clip "
            "with the config's gradient_clipping instead"
        )
    if eps_inside_sqrt:
        raise ValueError(f"{name}: eps_inside_sqrt=True is not built; remove it")
    if comm_backend_name not in ("nccl", "gloo", "compressed", "hccl"):
        raise ValueError(
            f"{name}: comm_backend_name={comm_backend_name!r}: the 1-bit all-reduce runs over "
            "the torch.distributed group (nccl, gloo, hccl); the MPI backend is not built"
        )
    if cuda_aware:
        raise ValueError(
            f"{name}: cuda_aware=True is an MPI option and the MPI backend is not built; "
            "remove it (the exchange runs over the torch.distributed group)"
        )


def check_steps(name: str, why: str = " (a warm-up step at least)", **steps: Any) -> None:
    """Whole counts of at least 1 (a warm-up step: the frozen variance and its bias
    correction need one). 2.9 is refused, not truncated to 2."""
    for key, value in steps.items():
        whole = isinstance(value, int) or isinstance(value, float) and value.is_integer()
        if isinstance(value, bool) or not whole:
            raise ValueError(f"{name}: {key}={value!r} must be a whole number of steps")
        if int(value) < 1:
            raise ValueError(f"{name}: {key}={value} must be >= 1{why}")
