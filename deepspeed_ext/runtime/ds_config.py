"""`deepspeed.DeepSpeedConfig` / `deepspeed.runtime.config.DeepSpeedConfig`: upstream's config
object, built from a path or dict (and the data-parallel size, from an mpu or the world), with
the attribute names upstream code reads. The typed config is its `.typed`."""

from __future__ import annotations

from typing import Any

from deepspeed_ext import comm
from deepspeed_ext.config import DeepSpeedConfig as TypedConfig
from deepspeed_ext.config import parse


def _dp_world_size(mpu: Any) -> int:
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    return comm.get_world_size() if comm.is_initialized() else 1


class DeepSpeedConfig:
    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        if mesh_device is not None:
            raise ValueError(
                "DeepSpeedConfig(mesh_device=...): device meshes come with sequence/tensor "
                "parallelism, not built yet; pass mpu= or nothing"
            )
        self.typed: TypedConfig = parse(config)
        self.world_size = _dp_world_size(mpu)
        sizes = self.typed.resolve_batch(self.world_size, "the data-parallel world size")
        self.train_batch_size = sizes.train_batch_size
        self.train_micro_batch_size_per_gpu = sizes.micro
        self.gradient_accumulation_steps = sizes.gas
        t = self.typed
        self.zero_config = t.zero_optimization
        self.zero_optimization_stage = int(t.zero_optimization.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled = bool(t.fp16.enabled)
        self.bfloat16_enabled = bool(t.bf16.enabled)
        self.fp16_auto_cast = bool(t.fp16.auto_cast)
        self.gradient_clipping = float(t.gradient_clipping)
        self.steps_per_print = t.steps_per_print
        self.wall_clock_breakdown = bool(t.wall_clock_breakdown)
        self.optimizer_name = t.optimizer.type.lower() if t.optimizer.type else None
        self.optimizer_params = dict(t.optimizer.params or {})
        self.scheduler_name = t.scheduler.type
        self.scheduler_params = dict(t.scheduler.params or {})
        # upstream's parsed section: {"mode": ..., "block": ..., ...} or None
        sa = t.sparse_attention
        self.sparse_attention = sa.layout_args() if sa is not None else None
        self._param_dict = t.raw  # upstream keeps the user's dict under this name

    def print(self, name: str) -> None:
        from deepspeed_ext.utils.logging import logger

        logger.info(f"{name}: {self.typed.to_dict()}")
