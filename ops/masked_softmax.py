"""The row softmax of the torch-op paths, with the kernels' rule for a row whose every entry is
-inf (everything masked out): it attends to nothing and gives zeros, not NaN (the C++ rule is
csrc/includes/fast_math.h's softmax_row)."""

from __future__ import annotations

import torch


def softmax_or_zeros(z: torch.Tensor) -> torch.Tensor:
    dead = torch.isneginf(z.amax(-1, keepdim=True))
    return torch.softmax(z.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
