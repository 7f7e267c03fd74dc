"""Small deterministic models and data for engine tests."""

from __future__ import annotations

import torch
from torch import nn


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)
    )


def batch(step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch a rank sees at a micro-step: the same whoever asks."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 16, generator=g), torch.randn(size, 4, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x.to(next(model.parameters()).dtype))
    return nn.functional.mse_loss(out.float(), y)
