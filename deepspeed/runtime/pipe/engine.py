"""`deepspeed.runtime.pipe.engine`: upstream's import path."""

from deepspeed_ext.runtime.pipe import PipelineEngine, PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
