"""`deepspeed.runtime.pipe`: upstream's import path (modules, topology, engine, schedules)."""

from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from .topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
]
