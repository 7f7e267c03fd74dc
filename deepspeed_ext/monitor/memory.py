"""memory_breakdown: memory per phase (forward, backward, step) on the metrics line.

For each phase: the peak while it ran and what stayed in use when it ended, in MB, the
largest over the print window. On a GPU these are the allocator's allocated bytes; on the CPU
the process's resident set (VmHWM reset at the phase start, VmRSS at its end), which counts
memory the allocator keeps after a free too: the figure a user's machine must have.
"""

from __future__ import annotations

from typing import Any

MB = 1 << 20


class MemoryBreakdown:
    def __init__(self, enabled: bool, accelerator: Any) -> None:
        self.enabled = enabled
        self.acc = accelerator
        self.window: dict[str, float] = {}
        self._before_resets = 0  # the peak the phases' resets cleared

    def begin(self, name: str) -> None:
        if self.enabled:
            self._before_resets = max(self._before_resets, self.acc.max_memory_allocated())
            self.acc.reset_peak_memory_stats()

    def peak_bytes(self) -> int:
        """The run's peak so far (the metrics line's), which the per-phase resets keep."""
        return max(self._before_resets, self.acc.max_memory_allocated())

    def end(self, name: str) -> None:
        if not self.enabled:
            return
        for key, value in (
            (f"{name}_peak_mb", self.acc.max_memory_allocated() / MB),
            (f"{name}_end_mb", self.acc.memory_allocated() / MB),
        ):
            self.window[key] = max(self.window.get(key, 0.0), value)

    def take_mb(self) -> dict[str, float]:
        out, self.window = self.window, {}
        return out
