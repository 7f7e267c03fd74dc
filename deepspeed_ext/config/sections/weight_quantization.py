"""`weight_quantization`: quantize weights at load or after init (ZeRO-Inference style)."""

from __future__ import annotations

from typing import Literal

from ..types import EMPTY, Bool, FreeDict, Int, Section


class WeightQuantizationConfig(Section):
    # Present in the config means on (upstream's default is true).
    enabled: Bool = True
    num_bits: Int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: Int = 1
    quantized_initialization: FreeDict = EMPTY
    post_init_quant: FreeDict = EMPTY
