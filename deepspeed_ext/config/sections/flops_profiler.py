"""`flops_profiler`: profile one step's FLOPs, latency and parameters per module."""

from __future__ import annotations

from ..types import Bool, Float, Int, Section, Str


class FlopsProfilerConfig(Section):
    # Turning it on also turns on wall_clock_breakdown (upstream's rule).
    enabled: Bool = False
    # Extra forward FLOPs counted for activation recomputation.
    recompute_fwd_factor: Float = 0.0
    profile_step: Int = 1
    # -1: every depth.
    module_depth: Int = -1
    top_modules: Int = 1
    detailed: Bool = True
    # None: print to stdout.
    output_file: Str | None = None
