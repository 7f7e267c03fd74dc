"""`progressive_layer_drop` (legacy; removed upstream in 0.19): stochastic layer dropping."""

from __future__ import annotations

from ..types import Bool, Float, Section


class ProgressiveLayerDropConfig(Section):
    enabled: Bool = False
    theta: Float = 1.0
    gamma: Float = 0.001
