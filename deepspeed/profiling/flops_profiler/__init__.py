"""`deepspeed.profiling.flops_profiler`: upstream's names for deepspeed_ext's profiler."""

from . import profiler
from .profiler import *  # noqa: F403 - the same names at both of upstream's paths

__all__ = profiler.__all__
