"""Metrics and their sinks (layer 3: imports accelerator and utils only)."""

from .memory import MemoryBreakdown
from .metrics import StepMetrics
from .timers import PhaseTimers
from .writers import (
    CometWriter,
    CsvWriter,
    JsonLinesWriter,
    MonitorMaster,
    RankTimes,
    TensorBoardWriter,
    WandbWriter,
    monitors_enabled,
    rank_times_from_config,
    upstream_tag,
    writers_from_config,
)

__all__ = [
    "MemoryBreakdown",
    "PhaseTimers",
    "CometWriter",
    "CsvWriter",
    "JsonLinesWriter",
    "MonitorMaster",
    "RankTimes",
    "StepMetrics",
    "TensorBoardWriter",
    "WandbWriter",
    "monitors_enabled",
    "rank_times_from_config",
    "upstream_tag",
    "writers_from_config",
]
