"""`deepspeed.runtime.checkpoint_engine`: upstream's import path (a PipelineModule's layer-file
hooks are handed one of these)."""

from deepspeed_ext.runtime.checkpoint import CheckpointEngine, TorchCheckpointEngine

__all__ = ["CheckpointEngine", "TorchCheckpointEngine"]
