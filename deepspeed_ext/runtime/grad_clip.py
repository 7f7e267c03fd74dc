"""One fused unscale-and-clip multiply."""

from __future__ import annotations

import math


def clip_factor(inv_scale: float, norm: float, max_norm: float) -> float:
    """The one multiplier that unscales (1/loss_scale) and clips the unscaled norm to
    max_norm (torch's clip_grad_norm_ rule, with its 1e-6)."""
    factor = inv_scale
    if max_norm > 0 and math.isfinite(norm):
        # torch's and upstream's test is the factor's, not the norm's: a norm within 1e-6
        # below max_norm is scaled too (which matters when max_norm itself is tiny)
        factor *= min(1.0, max_norm / (norm + 1e-6))
    return factor
