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


def mean_grads(ranks: int = 2, size: int = 4) -> dict[str, torch.Tensor]:
    """The mlp's gradient of the mean loss over `ranks` ranks' first micro-batches: what a
    data-parallel step averages to."""
    model = mlp()
    grads: dict[str, torch.Tensor] = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in range(ranks):
        model.zero_grad()
        x, y = batch(0, rank, size=size)
        nn.functional.mse_loss(model(x), y).backward()
        for n, p in model.named_parameters():
            assert p.grad is not None
            grads[n] += p.grad / ranks
    return grads
