from . import experts, tensor_slices
from .checkpoint_engine import CheckpointEngine, TorchCheckpointEngine
from .clone import clone_tensors_for_torch_save
from .engine_io import RankFileReader, load_checkpoint, save_checkpoint
from .layout import model_states_name
from .safe_load import CheckpointError
from .safe_load import load as load_state_file
from .weights16 import consolidated_state_dict, save_16bit_model

__all__ = [
    "CheckpointEngine",
    "CheckpointError",
    "experts",
    "RankFileReader",
    "clone_tensors_for_torch_save",
    "consolidated_state_dict",
    "load_state_file",
    "load_checkpoint",
    "model_states_name",
    "save_16bit_model",
    "save_checkpoint",
    "TorchCheckpointEngine",
    "tensor_slices",
]
