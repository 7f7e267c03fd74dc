"""The model, data and loss of tests/data/upstream_pipe_ckpt (a checkpoint written by
upstream DeepSpeed's PipelineEngine): imported by the test here and, by file path, by the
script that wrote it under upstream's own install (make.py there). Layer classes are given
the spec classes so that each side builds them with its own LayerSpec / TiedLayerSpec. It
repeats pipe_runs.py's tiny GPT on purpose: the committed checkpoint fixes this model, which
must not change when the shared test model does."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, DIM, SEQ, MICRO, GAS, LR = 32, 16, 6, 2, 2, 1e-2


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def project(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ embed.weight.t()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def specs(layer_spec: Any, tied_layer_spec: Any) -> list[Any]:
    """Embedding tied to the head (used again through forward_fn), 4 blocks, a norm."""
    torch.manual_seed(0)
    return [
        tied_layer_spec("embed", Embed),
        *[layer_spec(Block) for _ in range(4)],
        layer_spec(nn.LayerNorm, DIM),
        tied_layer_spec("embed", Embed, forward_fn=project),
    ]


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for mb in range(GAS):
        g = torch.Generator().manual_seed(1000 * step + mb)
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out
