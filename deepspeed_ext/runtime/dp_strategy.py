"""Stage 0 (plain data parallelism) behind the gradient-strategy protocol ([Note: gradient
strategy]): full fp32 masters for 16-bit models, gradients in accumulation buckets
all-reduced over the data-parallel group ([Note: gradient path])."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.comm import collective_device, sum_tensor_over
from deepspeed_ext.comm.expert_groups import expert_buffers
from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.checkpoint import errors_restart
from deepspeed_ext.zero.fragments import Fragment, bind, state_owner
from deepspeed_ext.zero.module_state import load_module_state, module_state
from deepspeed_ext.zero.named_state import NamedState, is_per_element, missing_names, own_copy
from deepspeed_ext.zero.norms import sum_of_squares
from deepspeed_ext.zero.protocol import RankFiles, StrategyContext

from .grad_accumulation import GradAccumulator
from .precision import MasterWeights


class DataParallelStrategy:
    stage = 0
    partitioned_grads = False

    def __init__(self, ctx: StrategyContext) -> None:
        self.module = ctx.module
        params = list(ctx.module.parameters())
        self.masters = MasterWeights(params)
        self.grads = GradAccumulator(
            params,
            ctx.accum_dtype,
            ctx.bucket_numel,
            ctx.data,
            ctx.is_boundary,
            ctx.averaging,
            ctx.grad_exchange,
            ctx.hierarchy,
            ctx.comm_dtype,
        )
        trainable = [
            dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in ctx.model_groups
        ]
        self.model_groups = [g for g in trainable if g["params"]]
        self.mixed_grads_ok = False
        self.dp = ctx.data
        self.optimizer: Any = None
        self._trainable = {id(p) for g in self.model_groups for p in g["params"]}

    @property
    def sync_enabled(self) -> bool:
        return self.grads.sync_enabled

    @sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        self.grads.sync_enabled = value

    @property
    def local_grads(self) -> bool:
        """Each rank keeps its own gradients, unreduced ([Note: 1-bit Adam]: the optimizer
        exchanges its momentum instead)."""
        return self.grads.local

    @local_grads.setter
    def local_grads(self, value: bool) -> None:
        self.grads.local = value

    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        """The model's groups with trainable params, each param replaced by its master."""
        of = self.masters.master_of
        return [{**g, "params": [of[id(p)] for p in g["params"]]} for g in self.model_groups]

    def repoint(self, optimizer: torch.optim.Optimizer) -> None:
        self.masters.swap_into(optimizer)

    def begin_backward(self, boundary: bool) -> None:
        self.grads.begin(boundary)

    def end_backward(self) -> None:
        self.grads.finish()

    def grad_sq_sum(self) -> torch.Tensor:
        # after the all-reduce every data-parallel rank holds the same grads, but for the
        # experts spread over ranks ([Note: expert groups]): each of those is summed over its
        # expert-parallel group, which holds every expert once
        device = collective_device(self.dp)
        buckets = self.grads.buckets
        dense = [b for b, e in zip(buckets.buffers, buckets.experts) if e is None]
        sq = sum_of_squares(dense, device)
        if self.grads.local:  # each its own: the mean over ranks, one value everywhere (so
            return sum_tensor_over(sq, self.dp) / self.dp.size  # overflow and clipping agree)
        for groups, bufs in expert_buffers(buckets):
            sq = sq + sum_tensor_over(sum_of_squares(bufs, device), groups.expert)
        return sq

    def scale_grads_(self, factor: float) -> None:
        if factor != 1.0:
            for b in self.grads.flat():
                b.mul_(factor)

    def attach_optimizer(self, optimizer: Any) -> None:
        """Nothing to move (stage 3 sends NVMe-offloaded optimizer state to its files)."""
        self.optimizer = optimizer
        bind(list(self.module.parameters()), self)

    def state_roots(self, kind: str) -> list[torch.Tensor]:
        """Tensors whose storages hold one kind of state ([Note: offloading states]); an fp32
        model's masters are its own parameters (lp_params)."""
        params: list[torch.Tensor] = list(self.module.parameters())
        masters: list[torch.Tensor] = list(self.masters.masters) if self.masters.is_copy else []
        if kind == "lp_params":
            return params
        if kind == "hp_params":
            return masters
        if kind == "lp_grads":
            return [t.grad for t in params + masters if t.grad is not None]
        if kind == "contiguous_grad_buffer":
            return list(self.grads.flat())
        return []

    # -- [Note: param fragments]: the whole parameter on every rank --
    def fragment_owner(self, p: Any, which: str) -> tuple[Fragment, torch.Tensor] | None:
        if id(p) not in self._trainable:
            return None
        master = self.masters.master_of[id(p)]
        owner = state_owner(self.optimizer, master, which, self.grads.buckets.grad_view(p))
        return (
            (Fragment(0, 0, p.numel(), p.shape, 0, self.dp), owner) if owner is not None else None
        )

    @torch.no_grad()
    def write_model_param(self, p: Any, value: torch.Tensor) -> None:
        p.data.copy_(value.reshape(p.shape))

    def optimizer_step(self, optimizer: Any) -> None:
        optimizer.step()

    def before_step(self) -> None:
        self.masters.attach_grads(self.grads.grads())

    def after_step(self) -> None:
        self.masters.detach_grads()
        self.masters.copy_to_model()

    def zero_grads(self) -> None:
        self.grads.zero()

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()

    def grads_of(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        return [self.grads.buckets.grad_view(p) for p in params]

    # -- checkpoints: everything in the model-states file (rank 0 of the data group) --
    def model_state(self, optimizer: Any, exclude_frozen: bool) -> dict[str, Any]:
        names = [n for n, _ in self.module.named_parameters()]  # aligned with the masters
        masters = (
            dict(zip(names, [m.detach() for m in self.masters.masters]))
            if self.masters.is_copy  # fp32 masters of a 16-bit model
            else None
        )
        return {
            "module": module_state(self.module, exclude_frozen),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "master_weights": masters,
        }

    def rank_state(self, optimizer: Any) -> dict[str, Any] | None:
        """State of this rank's own: an optimizer's (1-bit Adam's error buffers), the
        compressed gradient exchange's (its error buffers)."""
        out: dict[str, Any] = {}
        own = getattr(optimizer, "per_rank_state_dict", None)
        if own is not None:
            out["optimizer_per_rank"] = own()
        if self.grads.exchange is not None:
            exchange: Any = self.grads.exchange
            out["grad_exchange"] = exchange.state_dict()
        return out or None

    def load_model_state(self, state: dict[str, Any], strict: bool, files: RankFiles) -> None:
        load_module_state(self.module, state, strict, files.where, 0)
        self.sync_masters_from_model()

    @torch.no_grad()
    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any], files: RankFiles) -> None:
        if state.get("optimizer") is None and not state.get("zero_stage"):
            logger.warning(f"{files.where} holds no optimizer state (saved without one)")
            return
        if state.get("optimizer") is None:
            raise CheckpointError(
                f"{files.where} holds no stage-0 optimizer state (it was written with "
                f"zero_optimization.stage {state.get('zero_stage')}, whose optimizer state is "
                "partitioned): load it with load_optimizer_states=False, or train with the "
                "stage it was saved with"
            )
        optimizer.load_state_dict(state["optimizer"])
        saved = state.get("master_weights")
        if saved is not None:
            names = [n for n, _ in self.module.named_parameters()]
            for m, n in zip(self.masters.masters, names):
                m.copy_(saved[n])
        # after the masters: 0/1 Adam's local steps leave each rank's params its own
        if hasattr(optimizer, "load_per_rank_state_dict") or self.grads.exchange is not None:
            self.load_per_rank(optimizer, files)
        if saved is not None or hasattr(optimizer, "load_per_rank_state_dict"):
            self.masters.copy_to_model()

    def load_per_rank(self, optimizer: Any, files: RankFiles) -> None:
        """Each rank's own state from its file (after the optimizer's)."""
        own = files.read(self.dp.rank) if files.has(self.dp.rank) else {}
        ok = True
        if hasattr(optimizer, "load_per_rank_state_dict"):
            ok &= optimizer.load_per_rank_state_dict(own.get("optimizer_per_rank"))
        exchange: Any = self.grads.exchange
        if exchange is not None:
            ok &= exchange.load_state_dict(own.get("grad_exchange"))
        if not ok:
            errors_restart(files.where, self.dp.rank, self.dp.size)

    def sync_masters_from_model(self) -> None:
        self.masters.copy_from_model()

    def param_names(self) -> list[list[str]]:
        """The names of each optimizer group's params (names the saved optimizer state)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in g["params"]] for g in self.model_groups]

    @torch.no_grad()
    def load_named_state(self, optimizer: Any, named: NamedState, where: Any) -> None:
        """[Note: named optimizer state]: this stage's params, whatever layout saved them."""
        if not self.model_groups:  # nothing trains here (a frozen pipeline stage)
            return
        current = optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for cg, mg, pnames in zip(current["param_groups"], self.model_groups, self.param_names()):
            missing_names(named, pnames, where)
            for pid, n, p in zip(cg["params"], pnames, mg["params"]):
                state[pid] = {
                    k: v.reshape(p.shape).clone()
                    if is_per_element(k, v, p.numel())
                    else own_copy(v)
                    for k, v in named.state[n].items()
                }
            groups.append({**named.options[pnames[0]], "params": cg["params"]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        if self.masters.is_copy:
            names = [n for n, _ in self.module.named_parameters()]
            for m, n in zip(self.masters.masters, names):
                if n in named.masters:
                    m.copy_(named.masters[n].view_as(m))
            self.masters.copy_to_model()
