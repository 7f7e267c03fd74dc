"""`deepspeed.pipe`: upstream's import path for pipeline parallelism."""

from deepspeed_ext.comm import ProcessTopology
from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
