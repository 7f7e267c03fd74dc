"""Squared L2 norms of gradient buffers without full-size temporaries."""

from __future__ import annotations

import torch


def sum_of_squares(tensors: list[torch.Tensor]) -> float:
    """sum(x^2): a dot product per tensor (fp32 accumulate; 16-bit tensors are widened one
    at a time), so no temporary the size of all gradients exists. inf/nan propagate."""
    total = 0.0
    for t in tensors:
        v = t.reshape(-1)
        v = v if v.dtype in (torch.float32, torch.float64) else v.float()
        total += float(torch.dot(v, v))
    return total
