"""End of backward as an autograd callback.

[Note: end of backward]
Gradient hooks arm an EndOfBackward as the first gradient of a backward pass arrives; it
queues a callback on the autograd engine, which runs once that backward pass is complete
(FSDP2 does the same). So whoever runs the backward (engine.backward, a plain
loss.backward(), a pipeline schedule, a recompute) leaves no reduction pending. finish() must
be idempotent: engine.backward also calls it afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.autograd import Variable


class EndOfBackward:
    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish = finish
        self._queued = False

    def arm(self) -> None:
        """Called from a gradient hook (inside a backward pass)."""
        if not self._queued:
            Variable._execution_engine.queue_callback(self._run)
            self._queued = True

    def _run(self) -> None:
        self._queued = False
        self._finish()
