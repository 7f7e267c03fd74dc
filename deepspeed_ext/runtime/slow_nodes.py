"""[Note: slow nodes]
`communication.slow_node_tolerance`: every `slow_node_interval` optimizer steps, every rank's
compute time over those steps ([Note: compute time] in comm/waits.py: wall time minus time
blocked in communication) is gathered over the world. In synchronous training the slow rank
is the one that computes longest: the others spend the difference waiting for it. A rank whose
compute time is above the median by more than the tolerance (a fraction: 0.25 = 25% slower)
is named with its host in a warning on rank 0, and the metrics get `slow ranks` (how many) and
`slowest compute` (the slowest rank's time over the median). Quiet when no rank is slow.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

from deepspeed_ext import comm
from deepspeed_ext.utils.logging import logger

DEFAULT_INTERVAL = 50  # steps between checks when slow_node_interval is not given


class SlowNodeMonitor:
    def __init__(self, tolerance: float, interval: int) -> None:
        self.tolerance = tolerance
        self.interval = interval
        self.rank = comm.get_rank()
        self.hosts: list[str] = comm.all_gather_object(socket.gethostname())
        self.slow: list[int] = []  # the last check's slow ranks
        self._window: dict[str, float] = {}
        self._restart()

    def _restart(self) -> None:
        self._t0 = time.perf_counter()
        self._blocked0 = comm.waits.total()

    def on_step(self, step: int) -> None:
        """Every rank calls this after each optimizer step (a collective every interval)."""
        if step % self.interval != 0:
            return
        wall = time.perf_counter() - self._t0
        compute = max(wall - (comm.waits.total() - self._blocked0), 0.0)
        times: list[float] = comm.all_gather_object(compute)
        self._restart()  # the gather's own wait belongs to no window
        median = statistics.median(times)
        limit = median * (1.0 + self.tolerance)
        self.slow = [r for r, t in enumerate(times) if t > limit]
        self._window = {
            "slow_ranks_n": float(len(self.slow)),
            "slowest_compute_x": max(times) / median if median > 0 else 1.0,
        }
        if self.rank == 0:
            for r in self.slow:
                logger.warning(
                    f"slow node: rank {r} on {self.hosts[r]} computed {times[r]:.3g} s in the "
                    f"last {self.interval} steps, {100 * (times[r] / median - 1):.0f}% above "
                    f"the median {median:.3g} s (communication.slow_node_tolerance "
                    f"{self.tolerance:g})"
                )

    def take_window(self) -> dict[str, float]:
        """The last check's figures for the metrics line, once."""
        out, self._window = self._window, {}
        return out


def from_config(config: Any) -> SlowNodeMonitor | None:
    section = config.communication
    if section.slow_node_tolerance is None:
        return None
    interval = section.slow_node_interval or DEFAULT_INTERVAL
    return SlowNodeMonitor(float(section.slow_node_tolerance), int(interval))
