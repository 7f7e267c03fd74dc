"""`deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine`: upstream's import path."""

from deepspeed_ext.runtime.checkpoint import TorchCheckpointEngine

__all__ = ["TorchCheckpointEngine"]
