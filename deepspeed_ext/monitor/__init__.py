"""Metrics and their sinks (layer 3: imports accelerator and utils only)."""

from .memory import MemoryBreakdown
from .metrics import StepMetrics
from .timers import PhaseTimers
from .writers import CsvWriter, JsonLinesWriter, TensorBoardWriter, writers_from_config

__all__ = [
    "MemoryBreakdown",
    "PhaseTimers",
    "CsvWriter",
    "JsonLinesWriter",
    "StepMetrics",
    "TensorBoardWriter",
    "writers_from_config",
]
