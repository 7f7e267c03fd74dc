"""One fused unscale-and-clip multiply."""

from __future__ import annotations

import math


def clip_factor(inv_scale: float, norm: float, max_norm: float) -> float:
    """The one multiplier that unscales (1/loss_scale) and, if the unscaled norm exceeds
    max_norm, clips to it (torch's clip_grad_norm_ rule, with its 1e-6)."""
    factor = inv_scale
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        factor *= max_norm / (norm + 1e-6)
    return factor
