"""`deepspeed.runtime.utils`: the helpers upstream code imports from here."""

from deepspeed_ext.runtime.dataloader import RepeatingLoader
from deepspeed_ext.runtime.memory_report import see_memory_usage

__all__ = ["RepeatingLoader", "see_memory_usage"]
