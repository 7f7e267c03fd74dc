"""`deepspeed.runtime.pipe.dualpipev`: upstream's import path for DualPipeV."""

from deepspeed_ext.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule

__all__ = ["DualPipeVEngine", "DualPipeVModule"]
