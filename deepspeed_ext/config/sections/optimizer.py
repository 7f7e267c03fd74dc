"""`optimizer`: which optimizer the engine builds, and its constructor arguments."""

from __future__ import annotations

from ..types import EMPTY, Bool, FreeDict, Section, Str


class OptimizerConfig(Section):
    # None: the client passes its own optimizer (or none).
    type: Str | None = None
    # Passed to the optimizer's constructor as keyword arguments; read-only.
    params: FreeDict = EMPTY
    legacy_fusion: Bool = False

    def active(self) -> bool:
        return self.type is not None
