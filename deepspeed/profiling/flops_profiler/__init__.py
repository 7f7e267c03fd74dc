"""`deepspeed.profiling.flops_profiler`: upstream's names for deepspeed_ext's profiler."""

from .profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
