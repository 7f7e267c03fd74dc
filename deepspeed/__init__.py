"""The `deepspeed` face: upstream DeepSpeed's import paths, re-exporting deepspeed_ext.

Nothing is defined here; every object has its one home in deepspeed_ext.
"""

from deepspeed_ext.comm import init_distributed
from deepspeed_ext.runtime.ds_config import DeepSpeedConfig
from deepspeed_ext.runtime.engine import DeepSpeedEngine
from deepspeed_ext.runtime.initialize import add_config_arguments, initialize
from deepspeed_ext.runtime.pipe import (  # deepspeed.PipelineEngine
    DualPipeVEngine,
    DualPipeVModule,
    PipelineEngine,
    PipelineModule,
)
from deepspeed_ext.runtime.tensor_parallel import set_autotp_mode, tp_model_init
from deepspeed_ext.utils.logging import log_dist, logger
from deepspeed_ext.version import __version__, __version_api__
from deepspeed_ext.zero.stage3.on_device import OnDevice

# transformers calls deepspeed.zero.Init after `import deepspeed`; Megatron-DeepSpeed reads
# deepspeed.PipelineEngine and deepspeed.pipe
from . import comm, ops, pipe, utils, zero  # deepspeed.utils.safe_get_full_grad, ...
from .runtime import (
    lr_schedules,
)  # accelerate reads deepspeed.runtime.lr_schedules after `import deepspeed`
from .runtime.activation_checkpointing import checkpointing  # deepspeed.checkpointing
from .runtime.lr_schedules import add_tuning_arguments

__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in __version_api__.split(".")
)
version = __version__

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedEngine",
    "DualPipeVEngine",
    "DualPipeVModule",
    "OnDevice",
    "PipelineEngine",
    "PipelineModule",
    "__version__",
    "add_config_arguments",
    "add_tuning_arguments",
    "checkpointing",
    "lr_schedules",
    "log_dist",
    "logger",
    "comm",
    "ops",
    "pipe",
    "zero",
    "init_distributed",
    "initialize",
    "set_autotp_mode",
    "tp_model_init",
    "utils",
    "version",
]
