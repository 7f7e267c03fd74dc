"""Metrics and their sinks (layer 3: imports accelerator and utils only)."""

from .memory import MemoryBreakdown
from .metrics import StepMetrics
from .timers import PhaseTimers
from .writers import (
    CometWriter,
    CsvWriter,
    JsonLinesWriter,
    RankTimes,
    TensorBoardWriter,
    WandbWriter,
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
    "RankTimes",
    "StepMetrics",
    "TensorBoardWriter",
    "WandbWriter",
    "rank_times_from_config",
    "upstream_tag",
    "writers_from_config",
]
