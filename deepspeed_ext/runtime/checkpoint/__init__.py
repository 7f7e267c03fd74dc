from .engine_io import load_checkpoint, save_checkpoint
from .safe_load import CheckpointError

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
