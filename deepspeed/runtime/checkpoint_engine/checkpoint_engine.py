"""`deepspeed.runtime.checkpoint_engine.checkpoint_engine`: upstream's import path."""

from deepspeed_ext.runtime.checkpoint import CheckpointEngine

__all__ = ["CheckpointEngine"]
