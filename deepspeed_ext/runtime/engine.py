"""DeepSpeedEngine: a thin orchestrator over config, comm, precision, gradients, optimizer,
schedule, metrics and checkpoints. Each concern lives in its own module; this file only
composes them and keeps the step counters.

Step protocol (upstream's): for every micro-batch `loss = engine(batch)`,
`engine.backward(loss)`, `engine.step()`; the optimizer runs on the micro-step that ends an
accumulation window (is_gradient_accumulation_boundary()).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.accelerator import get_accelerator
from deepspeed_ext.comm import layout as parallel_layout
from deepspeed_ext.comm.expert_groups import by_expert_groups, expert_groups_of
from deepspeed_ext.monitor import (
    MemoryBreakdown,
    MonitorMaster,
    PhaseTimers,
    StepMetrics,
    monitors_enabled,
    rank_times_from_config,
    writers_from_config,
)
from deepspeed_ext.monitor.flops_profiler.step import StepProfile
from deepspeed_ext.runtime.compression import compression_windows, gradient_exchange
from deepspeed_ext.runtime.node_topology import gradient_hierarchy
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.offload.nvme import aio_settings
from deepspeed_ext.zero.protocol import GradientStrategy, StrategyContext

from . import checkpoint as ckpt
from . import config_effects, moe_setup, slow_nodes, sparse_attention, tensor_parallel
from .activation_checkpointing import settings as activation_checkpointing
from .dataloader import DeepSpeedDataLoader, batch_tokens
from .engine_manual import EngineManual
from .engine_surface import EngineSurface
from .lr_schedules import get_lr_scheduler
from .optimizer_step import StepOutcome, optimizer_step
from .optimizers import build_optimizer
from .precision import autocast, cast_half, config_dtype, make_loss_scaler
from .precision.fp32_modules import compute_in_fp32
from .precision.module_cast import cast_module
from .strategy_factory import make_strategy, reduce_bucket_numel
from .zero_checks import CPU_OPTIMIZERS, check_zero_optimizer, optimizer_device

_ROUTES = frozenset({"train", "eval", "predict", "encode"})


def _tensors(params: Any) -> list[Any]:
    """Params as given: tensors, or named_parameters()'s (name, param) pairs."""
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]


class DeepSpeedEngine(EngineSurface, EngineManual, torch.nn.Module):
    pipeline_parallelism = False  # upstream's attribute: the model is a PipelineModule

    def __init__(
        self,
        model: torch.nn.Module,
        config: Any,
        optimizer: Any = None,
        model_parameters: Any = None,
        training_data: Any = None,
        lr_scheduler: Any = None,
        collate_fn: Any = None,
        dist_init_required: bool | None = None,
        mpu: Any = None,
    ) -> None:
        super().__init__()
        comm.init_distributed(dist_init_required=dist_init_required, verbose=False)
        if config.comms_logger.enabled:  # else a configure() the user made stays
            comm.configure(config)
        self.world_size = comm.get_world_size()
        self.rank = comm.get_rank()
        # [Note: parallel layout]: every data-parallel collective runs over layout.data
        # [Note: AutoTP in the engine]: tensor slicing adds a tensor axis to the layout
        tensor_parallel.check_rules(config)
        autotp_size = tensor_parallel.tp_size(config, model)
        self.layout = tensor_parallel.layout(mpu, autotp_size, model)
        parallel_layout.set_current(self.layout)
        self.mpu = mpu
        self.dp_world_size = self.layout.data.size
        self.dp_rank = self.layout.data.rank
        self.mp_world_size = self.layout.model.size
        self.config = config
        # upstream's attribute: what save_checkpoint hands a PipelineModule's layer-file
        # hooks ([Note: layer file hooks]); code written for upstream calls it too
        self.checkpoint_engine = ckpt.TorchCheckpointEngine()
        source = (
            "the torch.distributed world size"
            if mpu is None and autotp_size == 1
            else f"the data-parallel size ({self.layout.describe()})"
        )
        sizes = tensor_parallel.resolve_batch(config, self.layout, autotp_size, source)
        self._train_batch_size = sizes.train_batch_size
        self._micro_batch_size = sizes.micro
        self._gas = sizes.gas
        config.check_resolved()
        config_effects.at_start(config, pipeline=self.pipeline_parallelism)
        activation_checkpointing.configure_for_engine(config, mpu)

        sparse_attention.apply(model, config)  # [Note: sparse attention from the config]

        acc = get_accelerator()
        self.device = acc.device(acc.current_device())  # the CPU accelerator: plain "cpu"
        self.module = model.to(self.device)
        self.autotp = tensor_parallel.slice_for_engine(
            self.module, config, autotp_size, self.layout.tensor
        )
        # [Note: AutoTP in the engine]: the norm's group, and what this rank takes away
        self._norm_axis, self._tp_replicated = tensor_parallel.norm_parts(self.module, self.layout)
        half = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else None
        if half is not None:  # [Note: module cast]
            types = config.data_types
            # data_types.param_dtype, when given, is the one fp16 / bf16 gives (checked)
            cast_module(
                self.module,
                config_dtype(types.param_dtype or half),
                config_dtype(types.buffer_dtype) if types.buffer_dtype else None,
                types.keep_in_fp32_modules,
            )
        # [Note: torch_autocast]: the model stays fp32; the forward runs under torch.autocast
        self._autocast = autocast.autocast_dtype(config.torch_autocast, self.device.type)
        autocast.check(config, self._autocast)
        self._auto_cast = bool(config.fp16.auto_cast)
        if config.fp16_override_modules:  # (refused without fp16 or bf16)
            compute_in_fp32(self.module, config.fp16_override_modules, config_dtype(half))
        # [Note: expert groups]: before the broadcast, which skips spread experts
        self.moe_layers = moe_setup.configure(
            self.module,
            config,
            self.zero_optimization_stage(),
            self.pipeline_parallelism,
            self.layout.tensor.size,
        )
        self._broadcast_module()

        params = [p for p in self.module.parameters()]
        accum = self._accum_dtype(params)
        comm_dtype = self._comm_dtype(accum)
        self._reduce_dtype = comm_dtype or accum  # engine.communication_data_type
        elem = torch.tensor([], dtype=accum).element_size()
        model_groups = self._model_param_groups(optimizer, model_parameters)
        bucket = self._bucket_numel(params, elem)
        # engine.config reports what runs: the bucket size the runtime picked
        self.config = config = config.with_values({"zero_optimization.reduce_bucket_size": bucket})
        grad_exchange = gradient_exchange(config.gradient_compression, self.layout.data)
        hierarchy = gradient_hierarchy(config.communication, self.layout.data)
        self.strategy: GradientStrategy = make_strategy(
            StrategyContext(
                module=self.module,
                model_groups=model_groups,
                accum_dtype=accum,
                bucket_numel=bucket,
                device=self.device,
                optimizer_device=optimizer_device(config, self.device),
                data=self.layout.data,
                global_rank=self.rank,
                zero=config.zero_optimization,
                comm_dtype=comm_dtype,
                aio=aio_settings(config.aio),
                is_boundary=self.is_gradient_accumulation_boundary,
                averaging=comm.GradAverage.from_config(config),
                grad_exchange=grad_exchange,
                hierarchy=hierarchy,
            ),
            self.zero_optimization_stage(),
        )
        self.loss_scaler = make_loss_scaler(config.fp16) if config.fp16.enabled else None
        if self._autocast == torch.float16:
            self.loss_scaler = autocast.loss_scaler()
        self.optimizer = self._make_optimizer(optimizer)
        if hasattr(self.optimizer, "attach_engine"):  # a 1-bit optimizer, given as an object
            moe_setup.refuse_local_grads(self.moe_layers, type(self.optimizer).__name__)
        if self.zero_optimization_stage():
            check_zero_optimizer(self.optimizer, config, client=optimizer is not None)
            self.strategy.mixed_grads_ok = isinstance(self.optimizer, CPU_OPTIMIZERS)
        self.strategy.attach_optimizer(self.optimizer)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.collate_fn = collate_fn  # deepspeed_io() falls back to it, as upstream's
        self.training_dataloader = (
            self._training_loader(training_data, collate_fn) if training_data is not None else None
        )
        self.flops_profile = StepProfile(
            config.flops_profiler, self.module, self, lambda: self.global_steps, self.rank == 0
        )
        self.flops_profiler = self.flops_profile.profiler  # upstream's attribute
        memory = MemoryBreakdown(bool(config.memory_breakdown), acc)
        self.timers = PhaseTimers(
            # upstream's rule: the FLOPs profiler turns the wall-clock breakdown on
            bool(config.wall_clock_breakdown or config.flops_profiler.enabled),
            acc.synchronize,
            memory,
            watchers=[self.flops_profile],
        )
        self.slow_nodes = slow_nodes.from_config(config)  # [Note: slow nodes]
        self.metrics = StepMetrics(
            config.steps_per_print,
            writers_from_config(config) if self.rank == 0 else [],
            memory.peak_bytes,
            self.dp_world_size,
            self.timers,
            throughput=bool(config.timers.throughput.enabled),
            synchronize=acc.synchronize if config.timers.throughput.synchronized else None,
            sources=[
                activation_checkpointing.take_profile_ms,
                comm.comms_logger.take_window,
                *compression_windows(self.optimizer, grad_exchange),
                *([self.slow_nodes.take_window] if self.slow_nodes else []),
            ],
            rank_times=rank_times_from_config(config, self.rank, comm.waits.take),
            # the loss on the line is every data-parallel rank's mean (a pipeline's loss is
            # that already)
            loss_over_ranks=None if self.pipeline_parallelism else self._losses_over_ranks,
            monitored=monitors_enabled(config),
        )
        # upstream's engine.monitor: write_events() for the user's own scalars
        self.monitor = MonitorMaster(self.metrics.writers, monitors_enabled(config))
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._boundary_override: bool | None = None
        self._global_grad_norm: float | None = None
        self.overflow = False
        if self.optimizer is not None:
            self.optimizer.overflow = False
            self._show_loss_scale()
        # fp16 always skips a step whose gradients are not finite; bf16 when asked (upstream)
        self._skip_nonfinite = bool(
            self.loss_scaler is not None
            or (config.bf16.enabled and config.bf16.check_grad_overflow)
        )
        config_effects.dump_state(self)

    # -- construction helpers -----------------------------------------------------------------
    def _losses_over_ranks(self, total: float, count: float) -> tuple[float, float]:
        summed = comm.sums_over([total, count], self.layout.data)
        return summed[0], summed[1]

    def _accum_dtype(self, params: list[torch.nn.Parameter]) -> torch.dtype:
        name = getattr(getattr(self.config, "data_types", None), "grad_accum_dtype", None)
        if name:
            return config_dtype(name)
        if not params or any(p.dtype != torch.float32 for p in params):
            return torch.float32  # (no parameters: a pipeline stage of parameter-free layers)
        return params[0].dtype

    def _comm_dtype(self, accum: torch.dtype) -> torch.dtype | None:
        """communication_data_type's dtype where it differs from the accumulation dtype
        ([Note: communication dtype])."""
        name = self.config.communication_data_type
        if name is None:
            return None
        dtype = config_dtype(name)
        return None if dtype == accum else dtype

    def _bucket_numel(self, params: list[torch.nn.Parameter], elem: int) -> int:
        return reduce_bucket_numel(
            self.config.zero_optimization, self.zero_optimization_stage(), params, elem
        )

    def _broadcast_module(self) -> None:
        """Start every data-parallel rank from its group's rank 0 weights and buffers, as DDP
        does (other model-parallel ranks hold other parts of the model)."""
        with torch.no_grad():
            every = [*self.module.parameters(), *self.module.buffers()]
            # zero.Init broadcast the ds_id ones at construction; experts spread over ranks
            # start from their own copies' rank 0 ([Note: expert groups])
            plain = [
                t.data for t in every if not hasattr(t, "ds_id") and expert_groups_of(t) is None
            ]
            comm.group_broadcast_many(plain, self.layout.data)
            spread = ((expert_groups_of(p), p.data) for p in self.module.parameters())
            for groups, tensors in by_expert_groups(spread):
                comm.group_broadcast_many(tensors, groups.expert_data)

    def _model_param_groups(self, client: Any, model_parameters: Any) -> list[dict[str, Any]]:
        """The model's param groups: a client optimizer's, model_parameters (params or groups),
        or every module param in one group."""
        # a factory gets the params in the form they were given (upstream calls it with
        # model_parameters): a flat iterable unless groups were given
        self._given_flat = True
        if isinstance(client, torch.optim.Optimizer):
            return [dict(g) for g in client.param_groups]
        if model_parameters is None:
            return [{"params": list(self.module.parameters())}]
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            self._given_flat = False
            return [dict(g, params=_tensors(g["params"])) for g in items]
        return [{"params": _tensors(items)}]

    def _make_optimizer(self, client: Any) -> Any:
        """A client optimizer object (re-pointed at the fp32 masters or partitions), a callable
        taking the param groups, or the config's optimizer section."""
        if client is not None:
            _client_overrides("optimizer", "optimizer", self.config.optimizer)
        if isinstance(client, torch.optim.Optimizer):
            self.strategy.repoint(client)
            if hasattr(client, "attach_engine") and getattr(client, "deepspeed", None) is None:
                client.attach_engine(self)  # a 1-bit optimizer made before the engine
            return client
        if client is not None and not callable(client):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a callable, not {type(client)}"
            )
        if client is None and (self.config.optimizer is None or not self.config.optimizer.type):
            return None
        groups = self.strategy.optimizer_param_groups()
        if not groups:
            # nothing trains here: a frozen pipeline stage (the others train), or a frozen
            # model given an optimizer anyway (a reference model built from the training
            # config, as TRL builds one); the optimizer still carries the lr its scheduler
            # and checkpoints read
            groups = [{"params": []}]
            if not self.pipeline_parallelism:
                logger.warning(
                    "no parameter of the model requires a gradient: the optimizer has "
                    "nothing to train (unfreeze what should train: requires_grad=True)"
                )
        if callable(client):
            # (no params at all: the empty group, which torch's optimizers take, a flat
            # empty list they refuse)
            flat = self._given_flat and len(groups) == 1 and groups[0].keys() == {"params"}
            flat = flat and bool(groups[0]["params"])
            return client(list(groups[0]["params"]) if flat else groups)
        first = groups[0]["params"]
        master_device = first[0].device if first else optimizer_device(self.config, self.device)
        return build_optimizer(
            self.config.optimizer.type,
            groups,
            dict(self.config.optimizer.params or {}),
            on_cpu=master_device.type == "cpu",
            engine=self,
        )

    def _make_scheduler(self, client: Any) -> Any:
        """A client scheduler object, a callable taking the optimizer, or the config's."""
        if client is not None:
            _client_overrides("lr_scheduler", "scheduler", self.config.scheduler)
            # upstream's rule: a scheduler object is used as it is; any other callable (a
            # function, a scheduler class) is a factory called with the optimizer
            if isinstance(client, torch.optim.lr_scheduler.LRScheduler) or not callable(client):
                return client
            return client(self.optimizer)
        sched = self.config.scheduler
        if sched is None or not sched.type or self.optimizer is None:
            return None
        return get_lr_scheduler(sched.type, self.optimizer, dict(sched.params or {}))

    def _training_loader(self, dataset: Any, collate_fn: Any) -> Any:
        """The loader for deepspeed.initialize(training_data=...)."""
        return self.deepspeed_io(dataset, collate_fn=collate_fn)

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """Upstream's loader: one shard per data-parallel rank (or `data_sampler`'s), the
        micro-batch size, the collate_fn given to initialize unless another is given.
        `route` is upstream's train/eval/predict/encode tag: eval and predict read their
        shards in order (unshuffled), as upstream's."""
        if route not in _ROUTES:
            raise ValueError(f"deepspeed_io: route {route!r} is not one of {sorted(_ROUTES)}")
        if collate_fn is None:
            collate_fn = self.collate_fn
        return DeepSpeedDataLoader(
            dataset,
            batch_size or self._micro_batch_size,
            # pinned pages only help copies to an accelerator
            pin_memory=bool(pin_memory) and self.device.type != "cpu",
            local_rank=comm.get_local_rank(),
            collate_fn=collate_fn,
            num_local_io_workers=num_local_io_workers,
            data_sampler=data_sampler,
            data_parallel_world_size=self.dp_world_size,
            data_parallel_rank=self.dp_rank,
            dataloader_drop_last=bool(self.config.dataloader_drop_last),
            shuffle=route not in ("eval", "predict"),
        )

    # -- training ----------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._states_here("forward")
        if self.module.training and torch.is_grad_enabled():  # evaluation trains no sample
            # the configured micro-batch, as upstream counts it: a tensor's first dimension
            # is the sequence for sequence-first models, and a dict batch has no first one
            self.metrics.add_micro_batch(
                self.train_micro_batch_size_per_gpu(), batch_tokens(inputs, kwargs)
            )
        if self._auto_cast:  # fp16.auto_cast: the positional inputs, as upstream's
            inputs = cast_half(inputs)
        with self.timers.phase("forward"), self.autocast_forward():
            return self.module(*inputs, **kwargs)

    def autocast_forward(self) -> Any:
        """torch.autocast where torch_autocast is on ([Note: torch_autocast])."""
        return autocast.forward_context(self._autocast, self.device.type)

    def _show_loss_scale(self) -> None:
        """Upstream's fp16 optimizers carry the scale (`loss_scale`; ZeRO's `cur_scale` and
        `dynamic_loss_scale` too), which Megatron-style logging reads off the optimizer."""
        if self.loss_scaler is None or self.optimizer is None:
            return
        self.optimizer.loss_scale = self.optimizer.cur_scale = self.loss_scaler.loss_scale
        self.optimizer.dynamic_loss_scale = bool(self.loss_scaler.dynamic)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        self._states_here("backward")
        scaled = self._scaled_loss(loss, scale_wrt_gas)
        self._pending_backwards += 1
        self.strategy.begin_backward(self.is_gradient_accumulation_boundary())
        with self.timers.phase("backward"):
            scaled.backward(retain_graph=retain_graph)
            self.strategy.end_backward()
        # upstream returns the loss it backpropagated, divided by the accumulation steps
        # (not the loss scale's multiple)
        return loss / self._gas if scale_wrt_gas and self._gas > 1 else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        self._states_here("step")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if self._inside_no_sync():
            raise RuntimeError(
                "engine.step() inside engine.no_sync(): the gradients are not reduced over "
                "the data-parallel ranks yet, so each replica would step on its own; leave "
                "the no_sync() block first (upstream refuses it too)"
            )
        if boundary:  # upstream's count: a batch per optimizer step, whichever calls led here
            self.global_samples += self._micro_batch_size * self.dp_world_size * self._gas
            with self.timers.phase("step"):
                self._model_step(lr_kwargs or {})
            self._pending_backwards = 0
            if self.slow_nodes is not None:
                self.slow_nodes.on_step(self.global_steps)
            self.metrics.on_step(
                self.global_steps,
                self.global_samples,
                self.get_lr()[0] if self.optimizer else 0.0,
                self.loss_scaler.loss_scale if self.loss_scaler else None,
                self._global_grad_norm,
            )
        self.micro_steps += 1
        self._boundary_override = None

    def _check_unused(self) -> None:
        """zero_optimization.ignore_unused_parameters false (stages 1 and 2, as upstream's):
        a trainable param that got no gradient in the step stops training by name, on every
        rank alike (a rank stopping alone would leave the others in the next collective)."""
        zero = self.config.zero_optimization
        if zero.ignore_unused_parameters or zero.stage not in (1, 2):
            return
        names = self.strategy.unused_params()  # type: ignore[attr-defined]
        if comm.sum_over(float(bool(names))) > 0:  # on any rank
            which = (
                f"{names[:5]}{' ...' if len(names) > 5 else ''} got no gradient on this rank"
                if names
                else "a parameter got no gradient on another rank"
            )
            raise RuntimeError(
                f"zero_optimization.ignore_unused_parameters is false and {which} in this "
                "step: make every trainable parameter take part in the loss, freeze the unused "
                "ones (requires_grad=False), or set ignore_unused_parameters true"
            )

    def _model_step(
        self,
        lr_kwargs: dict[str, Any],
        replicated_sq: torch.Tensor | float = 0.0,
        pipe_extra: torch.Tensor | float = 0.0,
    ) -> StepOutcome:
        """[Note: optimizer step]: shared with the pipeline engine."""
        self._check_unused()
        if self._tp_replicated:
            replicated_sq = replicated_sq + tensor_parallel.replicated_grad_sq(
                self.strategy,
                self._tp_replicated,
                self.layout.data,
                comm.collective_device(self.layout.data),
            )
        scale = self.loss_scaler.loss_scale if self.loss_scaler else None
        out = optimizer_step(
            self.strategy,
            self.optimizer,
            self.loss_scaler,
            self.lr_scheduler,
            float(self.config.gradient_clipping or 0.0),
            self._norm_axis,  # the rest of the model: pipeline stages (x tensor slices)
            lr_kwargs,
            replicated_sq,
            pipe_extra,
            self._skip_nonfinite,
        )
        self.overflow = out.overflow
        self._step_applied = not out.overflow
        if self.optimizer is not None:  # upstream's optimizers carry it; the HF Trainer reads it
            self.optimizer.overflow = out.overflow
            self._show_loss_scale()
        if out.overflow:
            self.skipped_steps += 1
            scaled = (
                f"; loss scale {scale:g} -> {self.loss_scaler.loss_scale:g}"
                if self.loss_scaler is not None
                else ""
            )
            logger.info(
                f"step {self.global_steps + 1}: gradients not finite (overflow), step "
                f"skipped{scaled}"
            )
            self._global_grad_norm = math.inf  # upstream's: the skipped step's norm
        else:
            self._global_grad_norm = out.norm
        self.global_steps += 1
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        # counted from the last batch-size change (set_train_batch_size starts a new window)
        return (self.micro_steps - self._window_start + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = bool(is_boundary)

    @property
    def enable_backward_allreduce(self) -> bool:
        """Upstream's switch: False leaves each rank's gradients unreduced (1-bit Adam after
        its warm-up exchanges compressed momentum instead)."""
        return not getattr(self.strategy, "local_grads", False)

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, value: bool) -> None:
        if not hasattr(self.strategy, "local_grads"):
            if value:
                return  # reducing is all this stage does
            raise ValueError(
                f"enable_backward_allreduce=False needs zero_optimization.stage 0; stage "
                f"{self.zero_optimization_stage()} reduces gradients into partitions"
            )
        if not value:
            moe_setup.refuse_local_grads(self.moe_layers, "enable_backward_allreduce=False")
        self.strategy.local_grads = not value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate without reducing: the reduction happens on the next synced boundary.
        Not re-entrant, and step() is refused inside (as upstream's)."""
        if self._inside_no_sync():
            raise RuntimeError("engine.no_sync() is already active: it does not nest")
        self.strategy.sync_enabled = False
        try:
            yield
        finally:
            self.strategy.sync_enabled = True

    def _inside_no_sync(self) -> bool:
        """Inside no_sync(): a step would use gradients not reduced over the ranks."""
        return not getattr(self.strategy, "sync_enabled", True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending_backwards = 0
        self.strategy.zero_grads()
        for p in self.module.parameters():
            p.grad = None

    # -- queries -----------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bf16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: Any,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        return ckpt.save_checkpoint(
            self, save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters
        )

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[Any, Any]:
        out = ckpt.load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )
        self.metrics.resume_at(self.global_steps)  # the next window counts from here
        self._show_loss_scale()
        return out

    # hooks the pipeline engine overrides (runtime/checkpoint/engine_io.py calls them)
    def _write_module_files(self, tmp: Any, exclude_frozen: bool) -> None:
        """Every rank, into the checkpoint's temporary directory: files of the module's own
        (a pipeline's layer files); the model-states file holds the rest."""
        return None

    def _checkpoint_extras(self, tmp: Any, exclude_frozen: bool) -> dict[str, Any]:
        """More keys for the model-states file (written by data-parallel rank 0)."""
        return {}

    def _checkpoint_state(self, ckpt_dir: Any, path: Any, strict: bool) -> dict[str, Any]:
        """The model-states file to load, as the strategy reads it (which applies strict);
        from a checkpoint saved at another tensor-parallel size, this rank's cut of it
        ([Note: AutoTP checkpoints])."""
        state, self._ckpt_saved = ckpt.tensor_slices.state_to_load(self, ckpt_dir, path)
        return ckpt.experts.localize_module(self, ckpt_dir, state)

    def _load_optimizer_state(self, state: dict[str, Any], files: Any) -> None:
        saved = getattr(self, "_ckpt_saved", None)
        if saved is not None:  # saved at another tensor-parallel size
            ckpt.tensor_slices.load_optimizer(self, files.where, saved, ckpt.RankFileReader)
            return
        if state.get("moe") is not None and ckpt.experts.loads(self):
            ckpt.experts.load_optimizer(self, files, state)  # by name: any ep_size
            return
        self.strategy.load_optimizer_state(self.optimizer, state, files)

    def save_16bit_model(
        self,
        save_dir: Any,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        return ckpt.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0 (None elsewhere); every rank must call it. Also at
        stages 0-2, where upstream refuses: the HF Trainer and Accelerate save through it."""
        return ckpt.consolidated_state_dict(self, exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """Upstream's newer name, which Accelerate calls under tensor slicing."""
        return ckpt.consolidated_state_dict(self, exclude_frozen_parameters)

    def destroy(self) -> None:
        self.strategy.remove_hooks()
        self.metrics.close()

    # -- module passthrough --------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise


def _client_overrides(argument: str, section: str, value: Any) -> None:
    """Upstream's documented rule, said: initialize's argument replaces the config's section."""
    if value is not None and value.type and comm.get_rank() == 0:
        logger.warning(
            f'the config\'s {section} section (type "{value.type}") is not used: the {argument} '
            f"passed to deepspeed.initialize replaces it (remove one of the two)"
        )
