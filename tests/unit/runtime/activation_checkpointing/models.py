"""A small residual model whose blocks run through deepspeed.checkpointing (dropout inside,
so recomputation must replay the random numbers), and an embedding model whose checkpointed
input (token ids) needs no gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepspeed_ext.runtime import activation_checkpointing as ckpt


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Net(nn.Module):
    """mode: "none", "reentrant" (checkpoint) or "non_reentrant"."""

    def __init__(self, mode: str = "none", width: int = 16, depth: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.mode = mode
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = run(self.mode, b, x, scale=0.5)
        return self.head(x)


def run(mode: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    if mode == "reentrant":
        return ckpt.checkpoint(fn, *args, **kwargs)
    if mode == "non_reentrant":
        return ckpt.non_reentrant_checkpoint(fn, *args, **kwargs)
    return fn(*args, **kwargs)


class Embedder(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.mode = mode
        self.emb = nn.Embedding(10, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(run(self.mode, self.emb, ids)).sum()
