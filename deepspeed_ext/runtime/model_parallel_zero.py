"""ZeRO stage 3 asked for beside pipeline stages or tensor slicing runs as stage 2.

[Note: stage 3 under model parallelism]
Widely read guides print 3D configs with "zero_optimization": {"stage": 3} next to pipeline
stages and a tensor-parallel size. Here stage 3's per-module gathers do not compose with a
pipeline schedule's point-to-point passes nor with sliced layers, so such a config runs as
stage 2: optimizer states and gradients stay partitioned over the data-parallel ranks, and
the parameters are already split by the stages and slices. The engine says so once at start
and reports stage 2 (engine.config, zero_optimization_stage()). What only stage 3 can do is
refused by name: parameter offload, and optimizer offload to NVMe.
"""

from __future__ import annotations

from typing import Any

from deepspeed_ext.config import ConfigError
from deepspeed_ext.utils.logging import logger


def fallback_stage(config: Any, pipelined: bool) -> Any:
    """The config to run: `config`, or a copy at stage 2 ([Note: stage 3 under model
    parallelism]). pipelined: the model is (or becomes) a PipelineModule."""
    zero = config.zero_optimization
    tp = int(config.tensor_parallel.autotp_size) > 1
    if zero.stage != 3 or not (tp or pipelined):
        return config
    why = " and ".join(
        w for w, on in (("pipeline stages", pipelined), ("tensor slicing", tp)) if on
    )
    stage3_only = {
        "zero_optimization.offload_param": zero.offload_param is not None
        and zero.offload_param.device != "none",
        'zero_optimization.offload_optimizer.device "nvme"': zero.offload_optimizer is not None
        and zero.offload_optimizer.device == "nvme",
    }
    for key, on in stage3_only.items():
        if on:
            raise ConfigError(
                f"{key} needs zero_optimization.stage 3, which runs as stage 2 with {why} "
                "(parameters are split by the stages and slices already): remove it, or "
                "drop the model parallelism"
            )
    logger.warning(
        f"zero_optimization.stage 3 with {why}: running stage 2 (optimizer states and "
        "gradients partitioned over the data-parallel ranks; the parameters are already "
        "split by the stages and slices, and stage 3's per-module gathers do not compose with "
        "them); the stage3_* settings have no effect"
    )
    return config.with_values({"zero_optimization.stage": 2})
