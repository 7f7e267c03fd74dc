"""`deepspeed.runtime.pipe.module`: upstream's import path."""

from deepspeed_ext.runtime.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
