"""`amp` (legacy; removed upstream in 0.19): NVIDIA Apex AMP. Every key but `enabled` is an
argument of apex.amp.initialize."""

from __future__ import annotations

from typing import Any

from ..types import Bool, Section


class AmpConfig(Section):
    enabled: Bool = False
    opt_level: Any = None
    cast_model_type: Any = None
    patch_torch_functions: Any = None
    keep_batchnorm_fp32: Any = None
    master_weights: Any = None
    loss_scale: Any = None
    cast_model_outputs: Any = None
    num_losses: Any = None
    verbosity: Any = None
    min_loss_scale: Any = None
    max_loss_scale: Any = None
