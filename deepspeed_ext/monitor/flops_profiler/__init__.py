"""The FLOPs profiler (upstream's deepspeed.profiling.flops_profiler API)."""

from .model_profile import get_model_profile
from .peak import Peak, device_peak, measured_peak
from .profiler import FlopsProfiler, ModuleStats
from .units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "ModuleStats",
    "Peak",
    "device_peak",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "measured_peak",
    "number_to_string",
    "params_to_string",
]
