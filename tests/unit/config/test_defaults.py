"""Defaults match upstream DeepSpeed 0.19.8's code (its docs page lags in places; noted)."""

import sys

import pytest

from deepspeed_ext.config import parse

DEFAULTS = {
    # runtime/constants.py, runtime/config.py
    "train_batch_size": None,
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "steps_per_print": None,  # docs still say 10; code is None since 0.15
    "gradient_clipping": 1.0,  # 0.0 before 0.19
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "communication_data_type": None,
    "seq_parallel_communication_data_type": "fp32",
    "wall_clock_breakdown": False,
    "memory_breakdown": False,
    "dump_state": False,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "optimizer.type": None,
    "scheduler.type": None,
    # runtime/precision_config.py
    "fp16.enabled": False,
    "fp16.auto_cast": False,
    "fp16.loss_scale": 0.0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.enabled": False,
    "bf16.immediate_grad_update": False,
    "bf16.check_grad_overflow": True,
    "data_types.grad_accum_dtype": None,
    # runtime/zero/config.py (docs: sub_group_size 1e12, prefetch 5e8; code below)
    "zero_optimization.stage": 0,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.reduce_bucket_size": None,  # upstream 5e8; sized by the runtime here
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.overlap_comm": False,  # True when stage is 3
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_model_persistence_threshold": sys.maxsize,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.offload_param": None,
    "zero_optimization.offload_optimizer": None,
    # monitor/config.py, comm/config.py, profiling/constants.py
    "tensorboard.enabled": False,
    "tensorboard.output_path": "",
    "tensorboard.job_name": "DeepSpeedJobName",
    "csv_monitor.job_name": "DeepSpeedJobName",
    "wandb.project": "deepspeed",
    "comet.samples_log_interval": 100,
    "comms_logger.prof_all": True,
    "comms_logger.prof_ops": (),
    "flops_profiler.profile_step": 1,
    "flops_profiler.module_depth": -1,
    "flops_profiler.top_modules": 1,
    "flops_profiler.detailed": True,
    # activation checkpointing, aio, checkpoint, pipeline
    "activation_checkpointing.partition_activations": False,
    "activation_checkpointing.number_checkpoints": None,
    "aio.block_size": 1_048_576,
    "aio.queue_depth": 8,
    "aio.intra_op_parallelism": 1,
    "aio.overlap_events": True,
    "checkpoint.tag_validation": "WARN",
    "checkpoint.load_universal": False,
    "pipeline.stages": "auto",
    "pipeline.partition": "best",
    "pipeline.activation_checkpoint_interval": 0,
}


def _get(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("path, expected", list(DEFAULTS.items()))
def test_default(path, expected):
    assert _get(parse({}), path) == expected


def test_offload_section_defaults():
    cfg = parse({"zero_optimization": {"offload_param": {}, "offload_optimizer": {}}})
    p, o = cfg.zero_optimization.offload_param, cfg.zero_optimization.offload_optimizer
    assert (p.device, p.nvme_path, p.pin_memory, p.buffer_count, p.buffer_size, p.max_in_cpu) == (
        "none", None, True, 5, 100_000_000, 1_000_000_000
    )  # fmt: skip
    assert (o.device, o.pin_memory, o.buffer_count, o.ratio, o.fast_init) == (
        "none", True, 4, 1.0, False
    )  # fmt: skip


def test_overlap_comm_defaults_on_for_stage_3_only():
    assert parse({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert parse({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    z = parse({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization
    assert z.overlap_comm is False
