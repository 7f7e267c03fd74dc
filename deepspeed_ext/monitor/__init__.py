"""Metrics and their sinks (layer 3: imports accelerator and utils only)."""

from .memory import MemoryBreakdown
from .metrics import StepMetrics
from .timers import PhaseTimers
from .writers import (
    CometWriter,
    CsvWriter,
    JsonLinesWriter,
    TensorBoardWriter,
    WandbWriter,
    upstream_tag,
    writers_from_config,
)

__all__ = [
    "MemoryBreakdown",
    "PhaseTimers",
    "CometWriter",
    "CsvWriter",
    "JsonLinesWriter",
    "StepMetrics",
    "TensorBoardWriter",
    "WandbWriter",
    "upstream_tag",
    "writers_from_config",
]
