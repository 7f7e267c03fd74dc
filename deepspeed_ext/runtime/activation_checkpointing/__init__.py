"""deepspeed.checkpointing: activation checkpointing with upstream's API
([Note: activation checkpointing] in function.py)."""

from .function import checkpoint, non_reentrant_checkpoint
from .rng import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
)
from .settings import (
    configure,
    is_configured,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]
