"""End of backward as an autograd callback.

[Note: end of backward]
Gradient hooks arm an EndOfBackward as the first gradient of a backward pass arrives
that nobody opened with begin_backward; it queues a callback on the autograd engine, which
runs once that backward pass is complete (FSDP2 does the same). So a plain loss.backward()
or a recompute leaves no reduction pending. A pass opened with begin_backward is closed by
end_backward alone: a zero-bubble W runs several autograd passes between the two
([Note: split backward]), and an end after the first would reduce too early. finish() must
be idempotent. (Stage 3 arms it on every pass: it runs no pipeline.)
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
