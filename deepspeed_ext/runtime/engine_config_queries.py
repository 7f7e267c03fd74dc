"""Upstream's engine methods that only read the config (`engine.zero_reduce_bucket_size()`,
`engine.wall_clock_breakdown()`, ...): one table from method name to config key, installed
on the engine surface. Values are the effective config's (engine.config), so a key the
runtime sizes itself reports the size in use."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_Z = "zero_optimization."
_OFF = _Z + "offload_optimizer"

# method name -> dotted config path
PATHS: dict[str, str] = {
    "aio_config": "aio",
    "autotp_size": "tensor_parallel.autotp_size",
    "tensor_parallel_config": "tensor_parallel",
    "autotuning_enabled": "autotuning.enabled",
    "autotuning_start_profile_step": "autotuning.start_profile_step",
    "autotuning_end_profile_step": "autotuning.end_profile_step",
    "autotuning_metric": "autotuning.metric",
    "autotuning_metric_path": "autotuning.metric_path",
    "bf16_master_weights_and_gradients": "bf16.bf16_master_weights_and_grads",
    "bf16_optimizer_states": "bf16.bf16_optimizer_states",
    "checkpoint_serialization_enabled": "checkpoint.checkpoint_serialization",
    "use_node_local_storage": "checkpoint.use_node_local_storage",
    "curriculum_enabled_legacy": "curriculum_learning.enabled",
    "data_efficiency_config": "data_efficiency",
    "data_efficiency_enabled": "data_efficiency.enabled",
    "dataloader_drop_last": "dataloader_drop_last",
    "dump_state": "dump_state",
    "eigenvalue_enabled": "eigenvalue.enabled",
    "eigenvalue_verbose": "eigenvalue.verbose",
    "eigenvalue_max_iter": "eigenvalue.max_iter",
    "eigenvalue_tol": "eigenvalue.tol",
    "eigenvalue_stability": "eigenvalue.stability",
    "eigenvalue_gas_boundary_resolution": "eigenvalue.gas_boundary_resolution",
    "eigenvalue_layer_name": "eigenvalue.layer_name",
    "eigenvalue_layer_num": "eigenvalue.layer_num",
    "elasticity_enabled": "elasticity.enabled",
    "flops_profiler_enabled": "flops_profiler.enabled",
    "flops_profiler_recompute_fwd_factor": "flops_profiler.recompute_fwd_factor",
    "flops_profiler_profile_step": "flops_profiler.profile_step",
    "flops_profiler_module_depth": "flops_profiler.module_depth",
    "flops_profiler_top_modules": "flops_profiler.top_modules",
    "flops_profiler_detailed": "flops_profiler.detailed",
    "flops_profiler_output_file": "flops_profiler.output_file",
    "fp16_auto_cast": "fp16.auto_cast",
    "fp16_master_weights_and_gradients": "fp16.fp16_master_weights_and_grads",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "graph_harvesting": "graph_harvesting",
    "log_level": "log_level",
    "memory_breakdown": "memory_breakdown",
    "sparse_gradients_enabled": "sparse_gradients",
    "mics_shard_size": _Z + "mics_shard_size",
    "optimizer_params": "optimizer.params",
    "optimizer_legacy_fusion": "optimizer.legacy_fusion",
    "scheduler_name": "scheduler.type",
    "scheduler_params": "scheduler.params",
    "pld_enabled": "progressive_layer_drop.enabled",
    "pld_theta": "progressive_layer_drop.theta",
    "pld_gamma": "progressive_layer_drop.gamma",
    "pld_params": "progressive_layer_drop",
    "quantize_training": "quantize_training",
    "torch_autocast_enabled": "torch_autocast.enabled",
    "torch_autocast_lower_precision_safe_modules": "torch_autocast.lower_precision_safe_modules",
    "zenflow_config": _Z + "zenflow",
    "zero_optimization": "zero_optimization",
    "zero_allgather_bucket_size": _Z + "allgather_bucket_size",
    "zero_allgather_partitions": _Z + "allgather_partitions",
    "zero_allgather_sequential": _Z + "stage3_allgather_sequential",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "zero_contiguous_gradients": _Z + "contiguous_gradients",
    "zero_elastic_checkpoint": _Z + "elastic_checkpoint",
    "zero_force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
    "zero_hpz_partition_size": _Z + "zero_hpz_partition_size",
    "zero_ignore_unused_parameters": _Z + "ignore_unused_parameters",
    "zero_legacy_stage1": _Z + "legacy_stage1",
    "zero_load_from_fp32_weights": _Z + "load_from_fp32_weights",
    "zero_log_trace_cache_warnings": _Z + "log_trace_cache_warnings",
    "zero_max_live_parameters": _Z + "stage3_max_live_parameters",
    "zero_max_reuse_distance": _Z + "stage3_max_reuse_distance",
    "zero_model_persistence_threshold": _Z + "stage3_model_persistence_threshold",
    "zero_module_granularity_threshold": _Z + "stage3_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce": _Z + "use_multi_rank_bucket_allreduce",
    "zero_offload_optimizer": _OFF,
    "zero_offload_param": _Z + "offload_param",
    "swap_tensor_config": _OFF,
    "zero_overlap_comm": _Z + "overlap_comm",
    "zero_param_persistence_threshold": _Z + "stage3_param_persistence_threshold",
    "zero_prefetch_bucket_size": _Z + "stage3_prefetch_bucket_size",
    "zero_quantized_gradients": _Z + "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights": _Z + "zero_quantized_nontrainable_weights",
    "zero_quantized_weights": _Z + "zero_quantized_weights",
    "zero_reduce_bucket_size": _Z + "reduce_bucket_size",
    "zero_reduce_scatter": _Z + "reduce_scatter",
    "zero_round_robin_gradients": _Z + "round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory": _Z + "save_muon_momentum_buffer_in_memory",
    "zero_sub_group_size": _Z + "sub_group_size",
    "zeropp_loco_param": _Z + "zeropp_loco_param",
}


def _read(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        if value is None:
            return None
        value = getattr(value, part)
    if hasattr(value, "model_dump"):  # a section: upstream hands out its config object/dict
        return value.model_dump()
    return dict(value) if hasattr(value, "keys") else value


def _offload_device(config: Any) -> str:
    off = config.zero_optimization.offload_optimizer
    return str(off.device) if off is not None else "none"


# method name -> function of the config, where it is not one key
DERIVED: dict[str, Callable[[Any], Any]] = {
    "amp_enabled": lambda c: bool(c.amp is not None and c.amp.enabled),
    "amp_params": lambda c: c.amp.model_dump() if c.amp is not None else None,
    "checkpoint_tag_validation_enabled": lambda c: c.checkpoint.tag_validation != "IGNORE",
    "checkpoint_tag_validation_fail": lambda c: c.checkpoint.tag_validation == "FAIL",
    "checkpoint_writer_enabled": lambda c: c.checkpoint.writer is not None,
    "cpuadam_cores_perc": lambda c: (
        c.zero_optimization.offload_optimizer.cpuadam_cores_perc
        if c.zero_optimization.offload_optimizer is not None
        else None
    ),
    "dynamic_loss_scale": lambda c: c.fp16.enabled and c.fp16.loss_scale == 0,
    "initial_dynamic_scale": lambda c: 2**c.fp16.initial_scale_power,
    "dynamic_loss_scale_args": lambda c: (
        {
            "init_scale": 2**c.fp16.initial_scale_power,
            "scale_window": c.fp16.loss_scale_window,
            "delayed_shift": c.fp16.hysteresis,
            "consecutive_hysteresis": c.fp16.consecutive_hysteresis,
            "min_scale": c.fp16.min_loss_scale,
        }
        if c.fp16.enabled and c.fp16.loss_scale == 0
        else None
    ),
    "optimizer_name": lambda c: c.optimizer.type.lower() if c.optimizer.type else None,
    "get_type": lambda c: c.optimizer.type,  # as the config gives it
    # features not built here: their sections are refused when enabled, so these report
    # the (disabled) configuration, as upstream's queries do
    "curriculum_learning_enabled": lambda c: (
        c.data_efficiency.data_sampling.curriculum_learning.enabled
    ),
    "curriculum_learning_config": lambda c: (
        c.data_efficiency.data_sampling.curriculum_learning.model_dump()
    ),
    "curriculum_params_legacy": lambda c: (
        c.curriculum_learning.model_dump() if c.curriculum_learning.enabled else False
    ),
    "data_sampling_enabled": lambda c: c.data_efficiency.data_sampling.enabled,
    "data_sampling_config": lambda c: c.data_efficiency.data_sampling.model_dump(),
    "random_ltd_enabled": lambda c: c.data_efficiency.data_routing.random_ltd.enabled,
    "random_ltd_config": lambda c: c.data_efficiency.data_routing.random_ltd.model_dump(),
    "load_universal_checkpoint": lambda c: c.checkpoint.load_universal,
    "autotuning_model_info_path": lambda c: (
        c.autotuning.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")
    ),
    "autotuning_profile_model_info": lambda c: bool(
        c.autotuning.enabled
        and c.autotuning.model_info is not None
        and c.autotuning.model_info.profile
    ),
    # upstream's rule: the FLOPs profiler turns the breakdown on
    "wall_clock_breakdown": lambda c: bool(c.wall_clock_breakdown or c.flops_profiler.enabled),
    "get_pld_theta": lambda c: None,  # progressive layer drop is not built (refused)
    # without MiCS every stage-3 rank holds a partition of the weights
    "is_first_weights_partition_group": lambda c: c.zero_optimization.stage == 3,
    "postscale_gradients": lambda c: not c.prescale_gradients,
    "torch_autocast_dtype": lambda c: c.torch_autocast.dtype,
    "zero_cpu_offload": lambda c: _offload_device(c) == "cpu",
    "zero_nvme_offload_optimizer": lambda c: _offload_device(c) == "nvme",
    "zero_use_cpu_optimizer": lambda c: _offload_device(c) in ("cpu", "nvme"),
    "zero_partial_offload": lambda c: (
        c.zero_optimization.offload_optimizer.ratio
        if c.zero_optimization.offload_optimizer is not None
        else 1.0
    ),
    "super_offload": lambda c: bool(
        c.zero_optimization.offload_optimizer is not None
        and c.zero_optimization.offload_optimizer.super_offload
    ),
}


def _path_method(name: str, path: str) -> Callable[[Any], Any]:
    def method(self: Any) -> Any:
        return _read(self.config, path)

    method.__name__ = name
    method.__doc__ = f"The config's `{path}` (upstream's engine.{name}())."
    return method


def _derived_method(name: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def method(self: Any) -> Any:
        return fn(self.config)

    method.__name__ = name
    method.__doc__ = f"Upstream's engine.{name}(), from the config."
    return method


def install(cls: type) -> None:
    """Add every query to cls, leaving alone any name cls already defines."""
    for name, path in PATHS.items():
        if not hasattr(cls, name):
            setattr(cls, name, _path_method(name, path))
    for name, fn in DERIVED.items():
        if not hasattr(cls, name):
            setattr(cls, name, _derived_method(name, fn))
