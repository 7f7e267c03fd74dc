"""Time this process spends in communication: blocking collectives and waits on async ones
([Note: compute time]).

[Note: compute time]
In synchronous data parallelism every rank's step takes as long as the slowest rank's: the
others wait for it in the gradient collectives. A rank's wall time per window therefore
names no straggler; its compute time does: the window's wall time minus what the rank spent
blocked in torch.distributed (sync calls, and Work.wait() on async ones). The slow rank
computes longest and waits least. On a GPU the host returns from NCCL calls before the
transfer ends, so this counts only host-side waits (the window's synchronize included).
"""

from __future__ import annotations

import time
from typing import Any

_total = 0.0  # seconds blocked since the process started
_taken = 0.0  # _total at take()'s last call


def add(seconds: float) -> None:
    global _total
    _total += seconds


def total() -> float:
    """Seconds blocked in communication so far (readers keep their own marks)."""
    return _total


def take() -> float:
    """Seconds blocked in communication since the last call."""
    global _taken
    out, _taken = _total - _taken, _total
    return out


class TimedWork:
    """An async collective's handle whose wait() counts as time blocked. Waiting again on
    a handle that completed returns at once: a second wait on a gloo send or receive blocks
    forever (its transfer is gone), and callers such as deepspeed.runtime.pipe.p2p's wait()
    may wait on handles their caller already waited on. A handle not yet complete (NCCL
    waited on one stream, now on another) is waited again."""

    def __init__(self, work: Any) -> None:
        self._work = work
        self._waited = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self._waited and self._work.is_completed():
            return True
        t0 = time.perf_counter()
        try:
            out = self._work.wait(*args, **kwargs)
            self._waited = True
            return out
        finally:
            add(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
