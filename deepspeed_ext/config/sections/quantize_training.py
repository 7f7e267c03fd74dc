"""`quantize_training` (legacy; removed upstream in 0.19): Mixture-of-Quantization (MoQ).
Sub-dicts pass through untyped."""

from __future__ import annotations

from typing import Any

from ..types import Bool, FreeDict, Section


class QuantizeTrainingConfig(Section):
    enabled: Bool = False
    quantize_verbose: Bool = False
    quantizer_kernel: Bool = False
    quantize_type: Any = None
    quantize_groups: Any = None
    # {start_bits, target_bits}, {quantize_period, schedule_offset}, ...
    quantize_bits: FreeDict | None = None
    quantize_schedule: FreeDict | None = None
    fp16_mixed_quantize: FreeDict | None = None
    # Upstream's tutorial spells it "quantize-algo" (aliases.py).
    quantize_algo: FreeDict | None = None
    eigenvalue: FreeDict | None = None
