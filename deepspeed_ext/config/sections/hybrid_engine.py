"""`hybrid_engine`: switch one model between training and inference kernels (RLHF)."""

from __future__ import annotations

from pydantic import Field

from ..types import Bool, Int, Section


class HybridEngineConfig(Section):
    enabled: Bool = False
    max_out_tokens: Int = Field(default=512, gt=0)
    inference_tp_size: Int = 1
    release_inference_cache: Bool = False
    pin_parameters: Bool = True
    tp_gather_partition_size: Int = 8
    enable_cuda_graph: Bool = False
