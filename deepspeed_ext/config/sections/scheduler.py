"""`scheduler`: which learning-rate schedule the engine builds, and its arguments."""

from __future__ import annotations

from ..types import EMPTY, FreeDict, Section, Str


class SchedulerConfig(Section):
    # None: the client passes its own scheduler (or none).
    type: Str | None = None
    # Passed to the scheduler's constructor as keyword arguments; read-only.
    params: FreeDict = EMPTY

    def active(self) -> bool:
        return self.type is not None
