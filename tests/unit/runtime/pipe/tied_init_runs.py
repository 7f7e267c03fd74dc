"""A tied pipeline model under seed_layers, built by 1F1B, interleaving and DualPipeV (run by
test_tied_init.py in spawned ranks), and the plain model built in layer order."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

D = 8


def _tied_out(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ mod.weight


def _mse(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((o - y) ** 2).mean()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)) for _ in range(4)]


def built(schedule: str) -> dict[str, Any]:
    """The tied weight each rank holds after initialize, and the eval loss."""
    import deepspeed
    from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec

    layers = [
        LayerSpec(nn.Linear, D, D),
        TiedLayerSpec("t", nn.Linear, D, D),
        LayerSpec(nn.Linear, D, D),
        TiedLayerSpec("t", nn.Linear, D, D, forward_fn=_tied_out),
        LayerSpec(nn.Linear, D, D),
    ]
    args: dict[str, Any] = {"num_stages": 2, "loss_fn": _mse, "seed_layers": True}
    if schedule == "dualpipev":  # rank 0 holds layers 0 and 3-4, rank 1 layers 1 and 2
        m: Any = DualPipeVModule(layers, partition_method=[0, 1, 2, 3, 5], **args)
    elif schedule == "interleaved":  # rank 0 holds layers 0 and 3, rank 1 layers 1-2 and 4
        m = PipelineModule(layers, partition_method=[0, 1, 3, 4, 5], virtual_stages=2, **args)
    else:
        m = PipelineModule(layers, partition_method=[0, 2, 5], **args)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    engine, *_ = deepspeed.initialize(
        model=m, config=config, optimizer=lambda g: torch.optim.SGD(g, lr=0.1)
    )
    loss = engine.eval_batch(iter(_batches()) if engine._needs_data() else None)
    return {"tied": m.tied_modules["t"].weight.detach().clone(), "loss": float(loss)}


def plain() -> dict[str, Any]:
    """The same layers built in order (layer i seeded 1234 + i, seed_layers' rule); the tied
    module is the first use's, layer 1."""
    mods = []
    for i in range(5):
        torch.manual_seed(1234 + i)
        mods.append(nn.Linear(D, D))
    with torch.no_grad():
        losses = [
            float(_mse(mods[4](mods[2](mods[1](mods[0](x))) @ mods[1].weight), y))
            for x, y in _batches()
        ]
    return {"tied": mods[1].weight.detach().clone(), "loss": sum(losses) / len(losses)}
