"""`timers`: the throughput timer behind the samples/sec report."""

from __future__ import annotations

from ..types import Bool, Section


class ThroughputTimerConfig(Section):
    enabled: Bool = True
    # Synchronize the device around each measurement: exact, but slower.
    synchronized: Bool = True


class TimersConfig(Section):
    throughput: ThroughputTimerConfig = ThroughputTimerConfig()
