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

__all__ = [
    "BATCH_INPUT_TIMER",
    "PIPE_RECV_GRAD_TIMER",
    "PIPE_RECV_INPUT_TIMER",
    "PIPE_SEND_GRAD_TIMER",
    "PIPE_SEND_OUTPUT_TIMER",
    "TRAIN_BATCH_TIMER",
    "PipelineEngine",
    "PipelineError",
]
