"""Upstream's engine accessors that callers (the HF Trainer, Accelerate, PEFT/TRL-style
trainers, upstream's docs) use, with upstream's names and behaviour. A mixin of the engine:
it only reads and adjusts what the engine composes."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.utils.logging import logger

from . import engine_config_queries


class EngineSurface:
    # set by the engine
    config: Any
    module: torch.nn.Module
    strategy: Any
    dp_world_size: int
    dp_rank: int
    _train_batch_size: int
    _micro_batch_size: int
    _gas: int
    micro_steps: int
    _window_start = 0  # the micro-step the current accumulation window began at
    # backward() calls since the last optimizer step (or zero_grad): gradients a checkpoint
    # does not hold. Counted here, not from micro_steps: Accelerate calls step() only at the
    # boundary, set by set_gradient_accumulation_boundary()
    _pending_backwards = 0
    _step_applied: bool = False
    _is_compiled: bool = False

    # -- batch sizes -------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self._train_batch_size, self._micro_batch_size, self._gas

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch size through the number of micro-batches per step; the
        micro-batch size stays. Call it between steps (at an accumulation boundary)."""
        per_micro = self._micro_batch_size * self.dp_world_size
        if train_batch_size <= 0 or train_batch_size % per_micro:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): it must be a positive multiple of "
                f"train_micro_batch_size_per_gpu x data-parallel size = {per_micro}"
            )
        self._set_batch(train_batch_size, self._micro_batch_size, train_batch_size // per_micro)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """A new micro-batch size; the accumulation steps stay, the global batch follows."""
        if micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): must be > 0")
        total = micro_batch_size * self._gas * self.dp_world_size
        self._set_batch(total, micro_batch_size, self._gas)

    def _set_batch(self, total: int, micro: int, gas: int) -> None:
        self._train_batch_size, self._micro_batch_size, self._gas = total, micro, gas
        self._window_start = self.micro_steps
        if hasattr(self, "micro_batches"):  # the pipeline engine's schedule length
            self.micro_batches = gas
        self.config = self.config.with_values(
            {
                "train_batch_size": total,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": gas,
            }
        )

    # -- state queries -----------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        """Whether the last step() updated the weights (an accumulation boundary whose
        gradients were finite)."""
        return self._step_applied

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def zero_optimization_partition_gradients(self) -> bool:
        return int(self.config.zero_optimization.stage) >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return int(self.config.zero_optimization.stage) >= 3

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def loss_scale(self) -> float:
        """The configured static loss scale (0: dynamic), as upstream's engine returns;
        the scale in use is engine.loss_scaler.loss_scale."""
        return float(self.config.fp16.loss_scale)

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

    def get_model_parallel_rank(self) -> int:
        return int(self.layout.model.rank)  # type: ignore[attr-defined]

    def get_tensor_parallel_rank(self) -> int:
        return int(self.layout.tensor.rank)  # type: ignore[attr-defined]

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's betas, or SGD's momentum."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in optimizer.param_groups]

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's dtype, the gradient accumulation dtype)."""
        model = next(self.module.parameters()).dtype
        return model, self._accum_dtype(list(self.module.parameters()))  # type: ignore[attr-defined]

    def get_wall_clock_timers(self) -> Any:
        return self.timers  # type: ignore[attr-defined]

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def is_deepcompile_enabled(self) -> bool:
        return bool(self.config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        return False  # DeepCompile is refused by the config (not built yet)

    def is_sanity_checks_enabled(self) -> bool:
        return bool(self.config.zero_optimization.enable_sanity_checks)

    # -- weights -----------------------------------------------------------------------------
    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The wrapped module's state_dict (at stage 3 the parameters are partitioned: use
        save_16bit_model or GatheredParameters for full weights)."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            for name in frozen:
                sd.pop(name, None)
        return sd

    def save_fp16_model(
        self,
        save_dir: Any,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Upstream's older name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)  # type: ignore[attr-defined]

    def empty_partition_cache(self) -> None:
        """Release the gathered ZeRO-3 parameters no module is using (between training and
        generation, say); a no-op below stage 3."""
        release = getattr(self.strategy, "empty_partition_cache", None)
        if release is not None:
            release()

    @property
    def global_rank(self) -> int:
        """This process's rank in the world (upstream's attribute)."""
        return int(self.rank)  # type: ignore[attr-defined]

    # -- states off the device ([Note: offloading states]) -----------------------------------
    _offloaded: Any = None

    def offload_states(
        self,
        include: Any = None,
        device: Any = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the training states (all kinds, or those in `include`: OffloadStateTypeEnum
        values) to host memory, freeing their device memory until reload_states()."""
        from . import offload_states as off

        where = str(getattr(device, "value", device))
        if where == "none":
            logger.warning("offload_states: device is none; nothing was moved")
            return
        if where != "cpu":
            raise ValueError(
                f"offload_states: device={where!r}; states can be moved to 'cpu' only "
                "(OffloadDeviceEnum.cpu), as upstream"
            )
        zero = self.config.zero_optimization
        if str(zero.offload_param.device if zero.offload_param else "none") != "none":
            raise RuntimeError(
                "offload_states: the parameters live off the device already "
                "(zero_optimization.offload_param); moving states is not supported with it"
            )
        if self.optimizer is None:  # type: ignore[attr-defined]
            raise RuntimeError("offload_states needs an optimizer: the engine was built without")
        off_opt = zero.offload_optimizer
        on_host = str(off_opt.device if off_opt else "none") in ("cpu", "nvme")
        self._offloaded = self._offloaded or off.Offloaded()
        off.offload(
            self._offloaded,
            off.refine(include, on_host),
            self.strategy.state_roots,
            self.optimizer,  # type: ignore[attr-defined]
            self.module,
            pin_memory,
            non_blocking,
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move what offload_states moved back to the device."""
        from . import offload_states as off

        if self._offloaded is not None:
            off.reload(self._offloaded, self.optimizer, self.module, non_blocking)  # type: ignore[attr-defined]

    def _states_here(self, action: str) -> None:
        """Training with states on the host would fail deep inside (or, on a CPU, silently
        train on the host copies): say what to call."""
        if self._offloaded is not None and self._offloaded.kinds:
            raise RuntimeError(
                f"engine.{action}: the states {', '.join(self._offloaded.kinds)} are offloaded "
                "(offload_states); call engine.reload_states() first"
            )

    # -- torch.compile -----------------------------------------------------------------------
    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """torch.compile the wrapped module in place (the engine's gradient hooks stay)."""
        if schedule is not None or compiled_autograd_enabled:
            raise ValueError(
                "engine.compile: schedule= and compiled_autograd_enabled= belong to DeepCompile, "
                "which is not built yet; call compile(backend=..., compile_kwargs=...)"
            )
        if self._is_compiled:
            logger.info("engine.compile: the module is compiled already")
            return
        self.module.compile(backend=backend, **(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in ([Note: communication dtype]): the config's
        communication_data_type, else the accumulation dtype (fp32 for a 16-bit model: what
        runs here, where upstream names the model's dtype)."""
        return self._reduce_dtype  # type: ignore[attr-defined]

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        raise AttributeError(
            "engine.communication_data_type is fixed when the engine is built; set "
            f"communication_data_type ({value!r}) in the DeepSpeed config instead"
        )


engine_config_queries.install(EngineSurface)
