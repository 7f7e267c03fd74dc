"""ZeRO stage 3 behind the engine's gradient-strategy interface (zero/strategy.py lists the
calls): parameters partitioned ([Note: stage-3 parameter]), gathered by module hooks
([Note: stage-3 hooks]), gradients reduce-scattered into shards ([Note: stage-3 gradient
reduction]); the optimizer steps one fp32 master shard per parameter, written back into the
parameter's shard with no collective (persistent parameters are re-gathered)."""

from __future__ import annotations

import math
from typing import Any

import torch

from deepspeed_ext.comm import all_reduce_sum_, get_rank, get_world_size

from ..norms import sum_of_squares
from .gather import gather_params, release_params
from .hooks import ModuleHooks
from .param import ZeroParamStatus, convert, is_zero_param
from .reduce import Stage3Reducer


class Stage3Options:
    def __init__(self, zero_cfg: Any, bucket_numel: int) -> None:
        self.bucket_numel = bucket_numel
        self.persistence_threshold = int(zero_cfg.stage3_param_persistence_threshold)
        self.model_persistence_threshold = int(zero_cfg.stage3_model_persistence_threshold)
        self.prefetch_numel = int(zero_cfg.stage3_prefetch_bucket_size)
        self.max_live_numel = int(zero_cfg.stage3_max_live_parameters)
        self.max_reuse_distance = int(zero_cfg.stage3_max_reuse_distance)
        off = zero_cfg.offload_param
        self.param_offload = str(off.device) if off is not None else "none"


class Stage3Strategy:
    stage = 3

    def __init__(
        self,
        module: torch.nn.Module,
        model_groups: list[dict[str, Any]],
        accum_dtype: torch.dtype,
        device: torch.device,
        optimizer_device: torch.device,
        options: Stage3Options,
    ) -> None:
        self.rank, self.world = get_rank(), get_world_size()
        self.options = options
        self.module = module
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._partition_all(module, device)
        self.hooks = ModuleHooks(module)
        self.group_options: list[dict[str, Any]] = []
        self.group_params: list[list[Any]] = []
        for g in model_groups:
            trainable = [p for p in g["params"] if p.requires_grad]
            if trainable:
                self.group_params.append(trainable)
                self.group_options.append({k: v for k, v in g.items() if k != "params"})
        self.trainable = [p for grp in self.group_params for p in grp]
        self.masters = {id(p): self._new_master(p, optimizer_device) for p in self.trainable}
        self.reducer = Stage3Reducer(
            self.trainable, accum_dtype, optimizer_device, options.bucket_numel
        )
        owned = {id(p) for p in self.trainable}
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad if id(p) in owned else _drop_grad)
            for p in module.parameters()
            if p.requires_grad
        ]
        self.sync_enabled = True
        self.mixed_grads_ok = False

    # -- construction --
    @torch.no_grad()
    def _partition_all(self, module: torch.nn.Module, device: torch.device) -> None:
        """Partition what zero.Init did not, in module order (ds_id equal on every rank)."""
        shard_device = torch.device("cpu") if self.options.param_offload != "none" else device
        persistent_left = self.options.model_persistence_threshold
        for p in module.parameters():
            persist = p.numel() <= self.options.persistence_threshold and (
                persistent_left >= p.numel()
            )
            if is_zero_param(p):
                self._adopt(p, device, shard_device)
                continue
            if persist:
                persistent_left -= p.numel()
            convert(p, self.rank, self.world, shard_device, device, persist)

    def _adopt(self, p: Any, device: torch.device, shard_device: torch.device) -> None:
        """A parameter zero.Init partitioned: follow the engine's dtype and devices."""
        if p.ds_tensor.dtype != p.dtype:  # the engine cast the (empty) model to 16 bits
            p.ds_tensor = p.ds_tensor.to(p.dtype)
        p.ds_tensor = p.ds_tensor.to(shard_device)
        p.ds_device = device
        if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
            p.data = p.data.to(device, dtype=p.ds_tensor.dtype)

    def _new_master(self, p: Any, device: torch.device) -> torch.nn.Parameter:
        m = torch.nn.Parameter(p.ds_tensor.detach().to(device, torch.float32), requires_grad=False)
        if hasattr(m, "grad_dtype"):  # torch >= 2.10: allow grads in the accumulation dtype
            m.grad_dtype = None

        def sync_master(m: torch.Tensor = m, p: Any = p) -> None:
            m.data.copy_(p.ds_tensor)  # GatheredParameters changed the parameter

        p.ds_master_sync = sync_master
        return m

    # -- optimizer wiring --
    def optimizer_param_groups(self, model_groups: Any = None) -> list[dict[str, Any]]:
        return [
            {**opts, "params": [self.masters[id(p)] for p in params]}
            for params, opts in zip(self.group_params, self.group_options)
        ]

    def repoint(self, optimizer: torch.optim.Optimizer) -> None:
        if len(optimizer.param_groups) != len(self.group_params):
            raise ValueError(
                "with ZeRO, each optimizer param group must hold trainable params: "
                f"{len(optimizer.param_groups)} groups but {len(self.group_params)} with "
                "trainable params"
            )
        for og, params in zip(optimizer.param_groups, self.group_params):
            og["params"] = [self.masters[id(p)] for p in params]

    # -- backward --
    def _on_grad(self, p: Any) -> None:
        g, p.grad = p.grad, None
        if g is not None:
            self.reducer.add(p, g)
        release_params([p])

    def begin_backward(self, boundary: bool) -> None:
        if not self.sync_enabled:
            raise RuntimeError(
                "no_sync() cannot be used with ZeRO stage 3: gradients are reduce-scattered "
                "every micro-step so that no rank keeps a full copy; use stage 0 or 1"
            )

    def end_backward(self) -> None:
        self.reducer.flush()
        release_params(self.module.parameters())

    # -- the step --
    def grad_norm(self) -> float:
        sq = torch.tensor(sum_of_squares(self.reducer.grads()), dtype=torch.float64)
        all_reduce_sum_(sq)
        return math.sqrt(float(sq))

    def scale_grads_(self, factor: float) -> None:
        if factor != 1.0:
            for g in self.reducer.grads():
                g.mul_(factor)

    def before_step(self) -> None:
        for p in self.trainable:
            m, g = self.masters[id(p)], self.reducer.part[id(p)]
            m.grad = g if g.dtype == m.dtype or self.mixed_grads_ok else g.float()

    @torch.no_grad()
    def after_step(self) -> None:
        for p in self.trainable:
            m = self.masters[id(p)]
            m.grad = None
            p.ds_tensor.copy_(m)
        self._refresh_persistent()

    def _refresh_persistent(self) -> None:
        """Persistent parameters stay gathered: their new values come from every rank."""
        persistent = [p for p in self.module.parameters() if p.ds_persist and p.requires_grad]
        release_params(persistent, force=True)
        gather_params(persistent)

    def zero_grads(self) -> None:
        self.reducer.zero()

    def remove_hooks(self) -> None:
        self.hooks.remove()
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()

    # -- checkpoint pieces (by parameter name) --
    def param_name(self, p: Any) -> str:
        return self.names[id(p)]

    def master_of(self, p: Any) -> torch.Tensor:
        return self.masters[id(p)]

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        for p in self.trainable:
            self.masters[id(p)].copy_(p.ds_tensor)


def _drop_grad(p: Any) -> None:
    """A trainable parameter outside every optimizer group: nothing steps it."""
    p.grad = None
    release_params([p])
