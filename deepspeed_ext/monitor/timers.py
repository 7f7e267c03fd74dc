"""wall_clock_breakdown: time spent in forward, backward and step, per window of steps (and
memory_breakdown's per-phase memory, measured at the same phase boundaries)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .memory import MemoryBreakdown


class PhaseWatcher(Protocol):
    """Something else that runs around each phase (the FLOPs profiler's step)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]: ...


class PhaseTimers:
    def __init__(
        self,
        enabled: bool,
        synchronize: Callable[[], None],
        memory: MemoryBreakdown | None = None,
        watchers: list[PhaseWatcher] | None = None,
    ) -> None:
        self.enabled = enabled
        self.watchers = watchers or []
        self.memory = memory if memory is not None and memory.enabled else None
        self.synchronize = synchronize  # device work must finish inside the phase it belongs to
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.memory is not None:
            self.memory.begin(name)
        try:
            with contextlib.ExitStack() as stack:
                for w in self.watchers:
                    stack.enter_context(w.phase(name))
                with self._timed(name):
                    yield
        finally:
            if self.memory is not None:
                self.memory.end(name)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = self.now()
        try:
            yield
        finally:
            self.since(name, t0)

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Times `name` alone (no memory row, no watcher): waits and transfers, not
        phases of compute."""
        return self._timed(name)

    def now(self) -> float:
        """A start for since(): the device's queued work done first (when timing)."""
        if self.enabled:
            self.synchronize()
        return time.perf_counter()

    def since(self, name: str, t0: float) -> None:
        """The time from `t0` (now()) to now, added under `name` (when timing): for a span
        that no `with` block can hold."""
        if self.enabled:
            self.totals[name] = self.totals.get(name, 0.0) + self.now() - t0

    def take_ms(self) -> dict[str, float]:
        """Milliseconds per phase since the last call, and reset."""
        out = {f"{k}_ms": v * 1e3 for k, v in self.totals.items()}
        self.totals = {}
        return out
