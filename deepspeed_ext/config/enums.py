"""Upstream's config enums (deepspeed.runtime.zero.config / offload_config), for code that
compares against them."""

from __future__ import annotations

import enum


class ZeroStageEnum(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"
