"""What a ZeRO config demands of the optimizer, checked at initialize with the key and fix."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed_ext.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed_ext.ops.lamb import FusedLamb
from deepspeed_ext.ops.lion import DeepSpeedCPULion

CPU_OPTIMIZERS = (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)
# Optimizers whose state is per element, so stepping a flat partition equals stepping the
# params one by one. LAMB is not: its trust ratio needs per-tensor norms.
TESTED = (
    *CPU_OPTIMIZERS,
    FusedAdam,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)


class ZeroConfigError(ValueError):
    pass


def offload_device(config: Any) -> str:
    off = config.zero_optimization.offload_optimizer
    return str(getattr(off, "device", "none") or "none") if off is not None else "none"


def optimizer_device(config: Any, model_device: torch.device) -> torch.device:
    dev = offload_device(config)
    if dev == "nvme" and config.zero_optimization.stage != 3:
        raise ZeroConfigError(
            "zero_optimization.offload_optimizer.device 'nvme' needs zero_optimization.stage 3 "
            "(ZeRO-Infinity); use device 'cpu' with stages 1-2"
        )
    return torch.device("cpu") if dev in ("cpu", "nvme") else model_device


def check_zero_optimizer(optimizer: Any, config: Any, client: bool) -> None:
    stage = config.zero_optimization.stage
    if optimizer is None:
        raise ZeroConfigError(
            f"zero_optimization.stage={stage} needs an optimizer: add an 'optimizer' section or "
            "pass optimizer= to deepspeed.initialize"
        )
    if isinstance(optimizer, FusedLamb):
        raise ZeroConfigError(
            "optimizer 'lamb' cannot run on ZeRO's flat partitions (its trust ratio needs each "
            "tensor whole); use zero_optimization.stage 0, or Adam/AdamW"
        )
    if client and not isinstance(optimizer, TESTED) and not config.zero_allow_untested_optimizer:
        raise ZeroConfigError(
            f"{type(optimizer).__name__} has not been tested with ZeRO, whose optimizer steps "
            'flat partitions of the params: set "zero_allow_untested_optimizer": true if its '
            "update is elementwise, or use DeepSpeedCPUAdam/FusedAdam/torch Adam(W)"
        )
    device = offload_device(config)
    if device in ("cpu", "nvme") and not isinstance(optimizer, CPU_OPTIMIZERS):
        if config.zero_force_ds_cpu_optimizer:
            raise ZeroConfigError(
                f"zero_optimization.offload_optimizer.device is {device!r} but the optimizer is "
                f"{type(optimizer).__name__}: offloaded partitions step with DeepSpeedCPUAdam "
                "(optimizer type 'adam'/'adamw' in the config does that), or set "
                '"zero_force_ds_cpu_optimizer": false to step them with this one on the CPU'
            )
