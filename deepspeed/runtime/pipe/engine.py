"""`deepspeed.runtime.pipe.engine`: upstream's import path."""

from deepspeed_ext.runtime.pipe import PipelineEngine, PipelineError
from deepspeed_ext.runtime.pipe.engine import (
    BATCH_INPUT_TIMER,
    PIPE_RECV_GRAD_TIMER,
    PIPE_RECV_INPUT_TIMER,
    PIPE_SEND_GRAD_TIMER,
    PIPE_SEND_OUTPUT_TIMER,
    TRAIN_BATCH_TIMER,
)
from deepspeed_ext.runtime.pipe.upstream_helpers import DATA_PARALLEL_ID, LOG_STAGE

__all__ = [
    "BATCH_INPUT_TIMER",
    "DATA_PARALLEL_ID",
    "LOG_STAGE",
    "PIPE_RECV_GRAD_TIMER",
    "PIPE_RECV_INPUT_TIMER",
    "PIPE_SEND_GRAD_TIMER",
    "PIPE_SEND_OUTPUT_TIMER",
    "TRAIN_BATCH_TIMER",
    "PipelineEngine",
    "PipelineError",
]
