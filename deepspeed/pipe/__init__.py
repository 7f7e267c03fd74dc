"""`deepspeed.pipe`: upstream's import path for pipeline parallelism."""

from deepspeed_ext.comm import ProcessTopology
from deepspeed_ext.runtime.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
