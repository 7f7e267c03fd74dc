"""Pipeline parallelism (upstream's deepspeed.pipe): PipelineModule, LayerSpec,
TiedLayerSpec, the 1F1B schedule and the PipelineEngine that runs it; DualPipeVModule and
its engine."""

from .dualpipev import DualPipeVEngine, DualPipeVModule
from .engine import PipelineEngine, PipelineError
from .module import PipelineModule
from .spec import LayerSpec, TiedLayerSpec

__all__ = [
    "DualPipeVEngine",
    "DualPipeVModule",
    "LayerSpec",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
]
