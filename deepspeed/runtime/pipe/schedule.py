"""`deepspeed.runtime.pipe.schedule`: upstream's import path."""

from deepspeed_ext.runtime.pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "DataParallelSchedule",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
]
