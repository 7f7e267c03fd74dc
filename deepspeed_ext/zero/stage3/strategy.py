"""ZeRO stage 3 behind the gradient-strategy protocol ([Note: gradient strategy]):
parameters partitioned over the data-parallel group ([Note: stage-3 parameter]), gathered
by module hooks ([Note: stage-3 hooks]), gradients reduce-scattered into shards ([Note:
stage-3 gradient reduction]); the optimizer steps one fp32 master shard per parameter,
written back into the parameter's shard with no collective (persistent parameters are
re-gathered)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed_ext.comm import (
    collective_device,
    group_broadcast_many,
    sum_tensor_over,
)
from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.utils.logging import logger

from ..backward_end import EndOfBackward
from ..client_groups import source_groups
from ..comm_options import reduce_options
from ..fragments import Fragment, bind, state_owner
from ..norms import sum_of_squares
from ..protocol import RankFiles, StrategyContext
from . import checkpoint
from .gather import gather_params, release_params
from .hooks import ModuleHooks
from .kept_whole import kept_whole
from .leaf import mark_config_leaves
from .param import (
    ZeroParamStatus,
    convert,
    ensure_storage,
    is_zero_param,
    new_flat,
    own_slice,
    read_shard,
    set_full,
    write_shard,
)
from .reduce import Stage3Reducer
from .tied import shared_param_ids


class Stage3Options:
    def __init__(self, zero_cfg: Any, bucket_numel: int, aio: dict[str, Any] | None = None) -> None:
        self.bucket_numel = bucket_numel
        self.persistence_threshold = int(zero_cfg.stage3_param_persistence_threshold)
        self.model_persistence_threshold = int(zero_cfg.stage3_model_persistence_threshold)
        self.prefetch_numel = int(zero_cfg.stage3_prefetch_bucket_size)
        self.max_live_numel = int(zero_cfg.stage3_max_live_parameters)
        self.max_reuse_distance = int(zero_cfg.stage3_max_reuse_distance)
        off = zero_cfg.offload_param
        self.param_offload = str(off.device) if off is not None else "none"
        self.param_nvme_path = getattr(off, "nvme_path", None)
        self.max_in_cpu = int(getattr(off, "max_in_cpu", 0))
        self.buffer_count = int(getattr(off, "buffer_count", 0))
        self.buffer_size = int(getattr(off, "buffer_size", 0))
        self.pin_memory = bool(getattr(off, "pin_memory", False))
        opt = zero_cfg.offload_optimizer
        self.optimizer_offload = str(opt.device) if opt is not None else "none"
        self.optimizer_nvme_path = getattr(opt, "nvme_path", None)
        # [Note: pipelined optimizer swap]
        self.pipeline_read = bool(getattr(opt, "pipeline_read", False))
        self.pipeline_write = bool(getattr(opt, "pipeline_write", False))
        # [Note: optimizer steps in backward]
        self.step_in_backward = bool(getattr(opt, "step_in_backward", False))
        # [Note: optimizer steps in forward]
        # None (unset): on where it applies
        self.step_in_forward: bool | None = getattr(opt, "step_in_forward", False)
        self.sub_group_numel = int(zero_cfg.sub_group_size)
        self.sub_group_given = "sub_group_size" in zero_cfg.model_fields_set
        self.leaf_module = zero_cfg.leaf_module
        self.allowed_types = zero_cfg.zero_allowed_param_types
        self.forced_types = zero_cfg.zero_force_param_types
        self.aio = {k: v for k, v in (aio or {}).items() if k != "use_gds"}


class Stage3Strategy:
    stage = 3
    partitioned_grads = True

    def __init__(self, ctx: StrategyContext, options: Stage3Options) -> None:
        module, model_groups = ctx.module, ctx.model_groups
        device, optimizer_device = ctx.device, ctx.optimizer_device
        self.dp = ctx.data  # parameters are partitioned over the data-parallel group
        self.rank, self.world = ctx.data.rank, ctx.data.size
        self.global_rank = ctx.global_rank
        self.options = options
        self.module = module
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._check_nvme_paths(module, model_groups)  # before anything is partitioned
        self._partition_all(module, device)
        self.swappers: list[Any] = []
        self.optimizer_swap: Any = None
        self.backward_steps: Any = None  # [Note: optimizer steps in backward]
        self.forward_steps: Any = None  # [Note: optimizer steps in forward]
        self._early_after = self._early_wait = 0.0  # deferred elements: state read early
        if options.param_offload == "nvme":
            self._params_to_nvme()
        self.end = EndOfBackward(self.end_backward)  # [Note: end of backward]
        mark_config_leaves(module, options.leaf_module)  # before the hooks go in
        self.hooks = ModuleHooks(module, options, self.dp, self.begin_pass, self._on_grad)
        self._in_backward = False
        self._engine_backward = False  # this backward came through engine.backward()
        self._plain_noted = False
        # persistence is fixed at partitioning: these stay gathered and are refreshed
        params: list[Any] = list(module.parameters())
        self.persistent = [p for p in params if p.ds_persist]
        self._fragments_resident = 0  # fragment_access() depth
        self._shards_from_whole()
        self.group_options: list[dict[str, Any]] = []
        self.group_params: list[list[Any]] = []
        for g in model_groups:
            trainable = [p for p in g["params"] if p.requires_grad]
            if trainable:
                self.group_params.append(trainable)
                self.group_options.append({k: v for k, v in g.items() if k != "params"})
        self.trainable = [p for grp in self.group_params for p in grp]
        self.trainable_ids = {id(p) for p in self.trainable}
        self.masters = {id(p): self._new_master(p, optimizer_device) for p in self.trainable}
        reduce_opts = reduce_options(ctx.zero, ctx.hierarchy)  # [Note: ZeRO communication keys]
        if "allgather_bucket_size" in ctx.zero.model_fields_set:
            logger.info(
                "zero_optimization.allgather_bucket_size applies to stages 1-2; stage 3 gathers "
                "parameters by stage3_prefetch_bucket_size"
            )
        self.reducer = Stage3Reducer(
            self.trainable,
            ctx.accum_dtype,
            optimizer_device,
            options.bucket_numel,
            self.dp,
            max_in_flight=1 if reduce_opts.overlap else 0,
            averaging=ctx.averaging,
            scatter=reduce_opts.scatter,
            comm_dtype=ctx.comm_dtype,
        )
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(
                self._on_grad if id(p) in self.trainable_ids else _drop_grad
            )
            for p in module.parameters()
            if p.requires_grad
        ]
        self.sync_enabled = True
        self.mixed_grads_ok = False

    # -- construction --
    @torch.no_grad()
    def _shards_from_whole(self) -> None:
        """A persistent parameter's whole value is what forward reads. An in-place edit made
        after zero.Init built it (a model's post-construction init outside
        GatheredParameters, as a Hugging Face model built under zero.Init makes) reached
        the whole value but not the shard the masters start from, and the first step then
        put the old value back: data-parallel rank 0's whole value becomes every rank's,
        and each shard is cut from it."""
        self._cut_shards(self.persistent)

    @torch.no_grad()
    def _cut_shards(self, params: list[Any]) -> None:
        """Data-parallel rank 0's whole values become every rank's, and each rank's shard
        is cut from them (a collective: every rank, the same params in the same order)."""
        group_broadcast_many([p.data for p in params], self.dp)
        for p in params:
            write_shard(p, own_slice(p.data.reshape(-1), self.dp.rank, self.dp.size))

    @torch.no_grad()
    def _partition_all(self, module: torch.nn.Module, device: torch.device) -> None:
        """Partition what zero.Init did not, in module order (ds_id equal on every rank)."""
        shard_device = torch.device("cpu") if self.options.param_offload != "none" else device
        persistent_left = self.options.model_persistence_threshold
        whole = kept_whole(module, self.options.allowed_types, self.options.forced_types)
        adopted: list[tuple[Any, bool]] = []  # zero.Init's, with the engine's persistence
        p: Any
        for name, p in module.named_parameters():
            p.ds_name = name
            if p.is_meta:
                raise ValueError(
                    f"parameter '{name}' is on the meta device (skip_init, device='meta'): it "
                    "has no values to partition; materialize it first (module.to_empty("
                    "device=...) and initialize its weights) and then call deepspeed.initialize"
                )
            numel = p.ds_numel if is_zero_param(p) else p.numel()  # zero.Init's: empty
            persist = numel <= self.options.persistence_threshold and persistent_left >= numel
            if persist:
                persistent_left -= numel
            if is_zero_param(p):
                self._adopt(p, device, shard_device)
                adopted.append((p, persist or id(p) in whole))
                continue
            convert(p, self.dp, shard_device, device, persist or id(p) in whole)
            if self.options.pin_memory and shard_device.type == "cpu" and device.type != "cpu":
                p.ds_tensor = p.ds_tensor.pin_memory()  # host-to-device copies run async
        self._repersist(adopted)

    def _check_nvme_paths(self, module: torch.nn.Module, groups: list[dict[str, Any]]) -> None:
        """An unusable nvme_path (not a writable directory, too little free space for this
        rank's share) is an error naming the key, raised before the model is touched."""
        from deepspeed_ext.zero.offload.nvme import check_nvme_path

        def shard(p: Any) -> int:
            return p.ds_shard_numel if is_zero_param(p) else -(-p.numel() // self.world)

        o = self.options
        if o.param_offload == "nvme":
            need = sum(shard(p) * p.element_size() for p in module.parameters())
            key = "zero_optimization.offload_param.nvme_path"
            check_nvme_path(str(o.param_nvme_path), need, key)
        if o.optimizer_offload == "nvme":
            trainable = [p for g in groups for p in g["params"] if p.requires_grad]
            need = 12 * sum(shard(p) for p in trainable)  # fp32 master + two moments
            key = "zero_optimization.offload_optimizer.nvme_path"
            check_nvme_path(str(o.optimizer_nvme_path), need, key)

    def _swapper(self, path: str | None, tag: str) -> Any:
        """Its path was checked by _check_nvme_paths (and required by the config checks)."""
        from deepspeed_ext.zero.offload.nvme import NVMeSwapper

        # named by global rank: ranks of other replicas share data-parallel ranks
        swapper = NVMeSwapper(str(path), self.global_rank, tag, self.options.aio)
        self.swappers.append(swapper)
        return swapper

    def _params_to_nvme(self) -> None:
        from .nvme import offload_params

        swapper = self._swapper(self.options.param_nvme_path, "params")
        o = self.options
        offload_params(
            list(self.module.parameters()), swapper, o.max_in_cpu, o.buffer_count, o.buffer_size
        )

    def state_roots(self, kind: str) -> list[torch.Tensor]:
        """Tensors whose storages hold one kind of state ([Note: offloading states]): this
        rank's parameter shards and the parameters kept whole; the fp32 masters; the
        gradient shards; the bucket pool (empty between steps)."""
        self.settle()
        params: list[Any] = list(self.module.parameters())
        masters: list[Any] = list(self.masters.values())
        if kind == "lp_params":
            return [p.ds_tensor for p in params if is_zero_param(p)] + params
        if kind == "hp_params":
            return masters
        if kind == "lp_grads":
            held = list(self.reducer.part.values())
            return held + [t.grad for t in params + masters if t.grad is not None]
        if kind == "contiguous_grad_buffer":
            return list(self.reducer.pool)
        return []

    def attach_optimizer(self, optimizer: Any) -> None:
        """With offload_optimizer nvme, the masters and their states go to swap files."""
        self.optimizer = optimizer
        bind(list(self.module.parameters()), self)
        if self.options.optimizer_offload != "nvme" or optimizer is None:
            return
        from .nvme import OptimizerSwap

        swapper = self._swapper(self.options.optimizer_nvme_path, "optimizer")
        o = self.options
        self.optimizer_swap = OptimizerSwap(
            swapper, o.sub_group_numel, o.pipeline_read, o.pipeline_write
        )
        self.optimizer_swap.attach(
            optimizer, self.trainable, [self.masters[id(p)] for p in self.trainable]
        )
        if o.step_in_backward:
            self._steps_in_backward()
        elif o.step_in_forward is not False:
            self._steps_in_forward(chosen=bool(o.step_in_forward))

    def _size_sub_groups(
        self, key: str, when: str, masters: list[Any], chosen: bool = True
    ) -> None:
        from .nvme import early_sub_group_numel

        o = self.options
        total = sum(p.ds_shard_numel for p in masters)
        size = early_sub_group_numel(
            key, when, total, o.sub_group_numel, o.sub_group_given, strict=chosen
        )
        o.sub_group_numel = self.optimizer_swap.sub_group_numel = size

    def _steps_in_forward(self, chosen: bool) -> None:
        """[Note: optimizer steps in forward]: persistent parameters (never read from their
        shards) step in engine.step(). Not `chosen` (the key unset, the default): only
        where something can step later, and sub_group_size only as an upper bound."""
        from .nvme_forward import EARLY_AFTER, ForwardSteps

        self._eager = frozenset(i for i, p in enumerate(self.trainable) if p.ds_persist)
        deferred = [p for p in self.trainable if not p.ds_persist]
        if not deferred and not chosen:
            return  # every trainable parameter is kept gathered: they step in engine.step()
        self._size_sub_groups(
            "step_in_forward", "as the next forward reaches them", deferred, chosen
        )
        self.forward_steps = ForwardSteps(self.optimizer_swap)
        self._early_after = EARLY_AFTER * sum(p.ds_shard_numel for p in deferred)
        if not chosen and self.rank == 0:
            logger.info(
                "offload_optimizer (nvme): each optimizer sub-group steps in the next forward, "
                "just before its parameters' first gather, so that its reads and writes "
                "overlap compute (zero_optimization.offload_optimizer.step_in_forward, on by "
                "default; set it false to step in engine.step())"
            )

    def settle(self) -> None:
        """Deferred optimizer steps done, and optimizer state read early dropped, before
        anything else reads or writes what they hold ([Note: optimizer steps in forward])."""
        if self.forward_steps is not None:
            self.forward_steps.settle()
            self.forward_steps.drop_early()

    def _settle_steps(self) -> None:
        """settle() on the way from a backward to its engine.step(), which reads neither
        masters nor optimizer state: the state read early stays, for defer() to take."""
        if self.forward_steps is not None:
            self.forward_steps.settle()

    def _steps_in_backward(self) -> None:
        """[Note: optimizer steps in backward]: sub-groups smaller than this rank's masters,
        so that some step before the backward ends; tied parameters step last."""
        from .nvme_backward import BackwardSteps

        self._size_sub_groups("step_in_backward", "during the backward", self.trainable)
        shared = shared_param_ids(list(self.module.modules()))
        late = {i for i, p in enumerate(self.trainable) if id(p) in shared}
        self.backward_steps = BackwardSteps(self.optimizer_swap, late)

    def optimizer_step(self, optimizer: Any) -> None:
        swap = self.optimizer_swap
        if swap is None:
            optimizer.step()
            return
        # the swapped step also writes the new values into the shards
        self._settle_steps()
        done: frozenset[int] = frozenset()
        steps = self.backward_steps
        if steps is not None and steps.open:
            done = steps.finish(self._grad_at)
        if self.forward_steps is not None:
            everything = frozenset(range(len(self.trainable)))
            # the persistent parameters, beside the sub-groups read early for the forward
            swap.step(self._grad_at, skip=everything - self._eager, exact=True)
            self.forward_steps.defer(self._grad_at, skip=self._eager)
        else:
            swap.step(self._grad_at, skip=done)

    def _grad_at(self, i: int) -> torch.Tensor:
        return self._grad_for(self.trainable[i])

    def _grad_for(self, p: Any) -> torch.Tensor:
        g = self.reducer.part_of(p)
        return g if g.dtype == torch.float32 or self.mixed_grads_ok else g.float()

    def _backward_steps_closed(self, what: str) -> None:
        """[Note: optimizer steps in backward]: between a boundary backward and engine.step()
        some sub-groups have stepped and one may be in memory: nothing else may read or
        write the masters' files then."""
        if self.backward_steps is not None and self.backward_steps.open:
            raise RuntimeError(
                f"{what} between a boundary backward and engine.step() with "
                "zero_optimization.offload_optimizer.step_in_backward: the optimizer is part "
                "way through its step; call engine.step() first"
            )

    @contextlib.contextmanager
    def fragment_access(self) -> Iterator[None]:
        """The fp32 masters and optimizer state in memory while a safe_get_* / safe_set_*
        accessor reads or writes them (offload_optimizer nvme: read in, written back)."""
        with self.resident_optimizer():
            self._fragments_resident += 1
            try:
                yield
            finally:
                self._fragments_resident -= 1

    def resident_optimizer(self) -> Any:
        """A context in which the optimizer's state is all in memory (checkpoints)."""
        self._backward_steps_closed("a checkpoint save or load")
        self.settle()
        swap = self.optimizer_swap
        return swap.resident() if swap is not None else contextlib.nullcontext()

    @torch.no_grad()
    def _repersist(self, adopted: list[tuple[Any, bool]]) -> None:
        """zero.Init's parameters take the engine's persistence, not Init's (one built
        without a config kept every parameter up to 100k elements whole on every rank): the
        ones to keep whole are gathered, the others released, all at once. One released
        keeps what its whole value held: an edit made after zero.Init built it reached the
        whole value, not the shard (see _shards_from_whole)."""
        gain = [p for p, keep in adopted if keep and not p.ds_persist]
        drop = [p for p, keep in adopted if not keep and p.ds_persist]
        if gain:
            for p in gain:
                p.ds_persist = True
            gather_params(gain)
        if drop:
            for p in drop:
                p.ds_persist = False
            self._cut_shards([p for p in drop if p.ds_status is ZeroParamStatus.AVAILABLE])
            release_params(drop, force=True)

    def _adopt(self, p: Any, device: torch.device, shard_device: torch.device) -> None:
        """A parameter zero.Init partitioned: follow the engine's dtype and devices."""
        if tuple(p.ds_process_group.ranks) != tuple(self.dp.ranks):
            raise ValueError(
                f"parameter '{p.ds_name}' was partitioned by zero.Init over ranks "
                f"{list(p.ds_process_group.ranks)}, but the engine's data-parallel group is "
                f"{list(self.dp.ranks)}: pass the same data_parallel_group/mpu to zero.Init "
                "and deepspeed.initialize"
            )
        if p.ds_tensor.dtype != p.dtype:  # the engine cast the (empty) model to 16 bits
            p.ds_tensor = p.ds_tensor.to(p.dtype)
        p.ds_tensor = p.ds_tensor.to(shard_device)
        p.ds_device = device
        dtype = p.ds_tensor.dtype
        if p.ds_flat.dtype == dtype and p.ds_flat.device == device:
            return
        value = p.data.to(device, dtype) if p.ds_status is ZeroParamStatus.AVAILABLE else None
        new_flat(p, device, dtype, self.world)
        if value is not None:  # persistent: refill the new buffer
            ensure_storage(p)
            p.ds_flat[: p.ds_numel].copy_(value.reshape(-1))
            set_full(p)

    def _new_master(self, p: Any, device: torch.device) -> torch.nn.Parameter:
        # An fp32 shard already where the optimizer runs is its own master (no second copy).
        shard = read_shard(p).detach()
        m = torch.nn.Parameter(shard.to(device, torch.float32), requires_grad=False)
        if hasattr(m, "grad_dtype"):  # torch >= 2.10: allow grads in the accumulation dtype
            m.grad_dtype = None

        def sync_master(m: torch.Tensor = m, p: Any = p) -> None:
            # GatheredParameters changed the parameter
            if self.optimizer_swap is not None:  # the master lives in its swap file
                self._backward_steps_closed("a GatheredParameters change")
                self.settle()
                self.optimizer_swap.write_master(p, read_shard(p))
            else:
                m.data.copy_(read_shard(p))

        p.ds_master_sync = sync_master
        return m

    # -- optimizer wiring --
    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        return [
            {**opts, "params": [self.masters[id(p)] for p in params]}
            for params, opts in zip(self.group_params, self.group_options)
        ]

    def repoint(self, optimizer: torch.optim.Optimizer) -> None:
        """A client optimizer built on the model params: each of its groups holds its
        trainable params' masters instead; a group of frozen params only (a LoRA base
        model's) is left empty, so the client's groups keep their number and order (and
        the optimizer state's parameter numbering follows group_params)."""
        sources = source_groups(optimizer, self.group_params)
        if sources != sorted(set(sources)):  # one ZeRO group per client group, in order
            raise ValueError(
                "with ZeRO stage 3, the optimizer's param groups must be the model's groups, "
                "in order: build the optimizer on the params given to deepspeed.initialize "
                "(model_parameters=, or the model's)"
            )
        for params, i in zip(self.group_params, sources):
            optimizer.param_groups[i]["params"] = [self.masters[id(p)] for p in params]

    # -- backward --
    def _on_grad(self, p: Any, holder: Any = None) -> None:
        """p's gradient, held by p or by the alias of one of its uses ([Note: per-use
        aliases of tied parameters]), into the reducer; p is released."""
        holder = p if holder is None else holder
        self.begin_pass()
        g, holder.grad = holder.grad, None
        if g is not None and id(p) in self.trainable_ids:
            self.reducer.add(p, g)
        release_params([p])

    def begin_backward(self, boundary: bool) -> None:
        if not self.sync_enabled:
            raise RuntimeError(
                "no_sync() cannot be used with ZeRO stage 3: gradients are reduce-scattered "
                "every micro-step so that no rank keeps a full copy; use stage 0 or 1"
            )
        self._engine_backward = True
        self._settle_steps()
        steps = self.backward_steps
        if steps is None:
            # armed for a boundary backward only (one that reached no parameter leaves it set)
            self.reducer.on_reduced = None
            if boundary and self.forward_steps is not None:
                self._early_wait = self._early_after
                self.reducer.on_reduced = self._reduced_early
            return
        if steps.open:  # [Note: optimizer steps in backward]
            raise RuntimeError(
                "a boundary backward with zero_optimization.offload_optimizer.step_in_backward "
                "already updated some parameters: call engine.step() before the next backward"
            )
        if boundary:
            steps.begin()
            self.reducer.on_reduced = self._reduced

    def _note_plain_backward(self) -> None:
        """The key has no effect on a backward the engine did not start: said once."""
        if not self._plain_noted:
            self._plain_noted = True
            logger.warning(
                "zero_optimization.offload_optimizer.step_in_backward: a backward ran through "
                "loss.backward() instead of engine.backward(loss), so the engine cannot tell an "
                "accumulation boundary: its optimizer steps run in engine.step(), as without "
                "the key"
            )

    def _reduced_early(self, params: list[Any]) -> None:
        """[Note: optimizer steps in forward]: the next step's first sub-groups are read once
        a fraction of the deferred masters' gradients are final."""
        self._early_wait -= sum(p.ds_shard_numel for p in params if not p.ds_persist)
        if self._early_wait <= 0:
            self.reducer.on_reduced = None
            self.forward_steps.read_early(self._eager)

    def _reduced(self, params: list[Any]) -> None:
        idx = [self.optimizer_swap.index[id(p)] for p in params]
        self.backward_steps.reduced(idx, self._grad_at)

    def begin_pass(self) -> None:
        """A backward pass is running (called from its hooks): arm the end callback."""
        self._settle_steps()
        self._in_backward = True
        self.end.arm()

    def end_backward(self) -> None:
        if not self._in_backward:  # already finished by the autograd callback
            return
        self._in_backward = False
        self.reducer.flush()
        self.reducer.on_reduced = None
        if self.backward_steps is not None and not self._engine_backward:
            self._note_plain_backward()
        self._engine_backward = False
        self.hooks.end_backward()
        release_params(self.module.parameters())

    # -- the step --
    def grad_sq_sum(self) -> torch.Tensor:
        self._settle_steps()  # engine.step() with no backward since the last: zeroing deferred
        sq = sum_of_squares(self.reducer.grads(), collective_device(self.dp))
        return sum_tensor_over(sq, self.dp)

    def scale_grads_(self, factor: float) -> None:
        if factor != 1.0:
            for g in self.reducer.grads():
                g.mul_(factor)

    def before_step(self) -> None:
        if self.optimizer_swap is None:  # swapped masters get theirs when swapped in
            for p in self.trainable:
                self.masters[id(p)].grad = self._grad_for(p)

    @torch.no_grad()
    def after_step(self) -> None:
        for p in self.trainable:
            m = self.masters[id(p)]
            m.grad = None
            if self.optimizer_swap is None:  # the swapped step wrote its shards already
                write_shard(p, m)
        self._refresh_persistent()

    def _refresh_persistent(self, trainable_only: bool = True) -> None:
        """Persistent parameters stay gathered: their new values come from every rank."""
        persistent = [p for p in self.persistent if p.requires_grad or not trainable_only]
        release_params(persistent, force=True)
        gather_params(persistent)

    def after_load(self) -> None:
        """Shards were loaded: gathered copies are stale."""
        self.settle()
        release_params(self.module.parameters(), force=True)
        self._refresh_persistent(trainable_only=False)

    def zero_grads(self) -> None:
        fwd = self.forward_steps
        if fwd is not None:  # a skipped step (overflow) defers nothing: no reason to keep it
            fwd.drop_early()
        if fwd is not None and fwd.pending and self.reducer.resident:
            fwd.after_settle = self.reducer.zero  # pending updates read them in place
        else:  # a pending update keeps its own reference to each partition
            self.reducer.zero()

    # -- [Note: param fragments]: a param's shard of every rank --
    def fragment_owner(self, p: Any, which: str) -> tuple[Fragment, torch.Tensor] | None:
        if id(p) not in self.trainable_ids:
            return None
        if self.optimizer_swap is not None and not self._fragments_resident:
            raise ValueError(  # zero/fragments.py's accessors read it inside fragment_access
                "the fp32 masters and optimizer states live in NVMe swap files "
                "(offload_optimizer nvme): read them inside strategy.fragment_access()"
            )
        master = self.masters[id(p)]
        owner = state_owner(self.optimizer, master, which, self.reducer.part_of(p))
        frag = Fragment(p.ds_shard_numel, 0, p.ds_numel, p.ds_shape, self.rank, self.dp)
        return (frag, owner) if owner is not None else None

    @torch.no_grad()
    def write_model_param(self, p: Any, value: torch.Tensor) -> None:
        """This rank's shard of the 16-bit (model) parameter, and the whole if gathered."""
        self.settle()
        s = p.ds_shard_numel
        flat = value.detach().reshape(-1)
        shard = torch.zeros(s, dtype=p.dtype, device=p.ds_tensor.device)
        mine = flat[self.rank * s : (self.rank + 1) * s]
        shard[: mine.numel()].copy_(mine)
        write_shard(p, shard)
        if p.ds_status is ZeroParamStatus.AVAILABLE:
            p.data.copy_(value.reshape(p.ds_shape))

    def empty_partition_cache(self) -> None:
        """engine.empty_partition_cache(): release every gathered parameter not in use."""
        release_params(self.module.parameters())

    def remove_hooks(self) -> None:
        try:
            self.settle()  # the swappers' I/O in flight finishes before they close
        finally:
            for s in self.swappers:
                s.close()
            self.hooks.remove()
            for h in self._grad_hooks:
                h.remove()
            self._grad_hooks.clear()

    def grads_of(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        raise RuntimeError(  # only pipelines ask, and they refuse stage 3 up front
            "stage 3 keeps no per-group gradient storage for pipeline tied weights"
        )

    def load_named_state(self, optimizer: Any, named: Any, where: Any) -> None:
        raise CheckpointError(  # only pipelines at another stage count ask; they refuse stage 3
            f"{where}: stage 3 resumes from its own rank files only"
        )

    # -- checkpoints ([Note: stage-3 checkpoint]) --
    def model_state(self, optimizer: Any, exclude_frozen: bool) -> dict[str, Any]:
        """Buffers and the parameter table; every parameter value is in the rank files."""
        self.settle()
        return {
            "module": checkpoint.module_buffers(self.module),
            "zero3_params": checkpoint.param_table(self.module),
        }

    def rank_state(self, optimizer: Any) -> dict[str, Any] | None:
        self.settle()
        return checkpoint.rank_payload(self, optimizer)

    def load_model_state(self, state: dict[str, Any], strict: bool, files: RankFiles) -> None:
        self.settle()
        checkpoint.load_weights(self, state, files)

    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any], files: RankFiles) -> None:
        self.settle()
        checkpoint.load_optimizer(self, optimizer, state, files)

    # -- checkpoint pieces (by parameter name) --
    def param_name(self, p: Any) -> str:
        return self.names[id(p)]

    def master_of(self, p: Any) -> torch.Tensor:
        return self.masters[id(p)]

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        self.settle()
        for p in self.trainable:
            self.masters[id(p)].copy_(read_shard(p))

    @torch.no_grad()
    def gathered_state_dict(self, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
        """The full state dict on rank 0 (None elsewhere), gathering one module at a time;
        every rank must call it. Tied parameters appear under each of their names."""
        self.settle()
        from .gathered import GatheredParameters

        out: dict[str, torch.Tensor] = {}
        for prefix, m in self.module.named_modules():
            own = list(m.named_parameters(recurse=False))
            with GatheredParameters([p for _, p in own]):
                if self.rank == 0:
                    for n, p in own:
                        if p.requires_grad or not exclude_frozen:
                            out[f"{prefix}.{n}" if prefix else n] = p.detach().cpu().clone()
        if self.rank != 0:
            return None
        param_keys = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        for k, v in self.module.state_dict().items():
            if k not in param_keys:  # buffers
                out[k] = v.detach().cpu().clone()
        return out


def _drop_grad(p: Any) -> None:
    """A trainable parameter outside every optimizer group: nothing steps it."""
    p.grad = None
    release_params([p])
