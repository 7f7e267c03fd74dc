"""ZeRO 3 with TiledLinear layers (importable by spawned ranks)."""

from __future__ import annotations

import torch


def _plain() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.Linear(20, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 12, generator=g), torch.randn(4, 3, generator=g)


def reference(steps: int, world: int) -> list[float]:
    model = _plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.cat([_batch(step, r)[0] for r in range(world)])
        y = torch.cat([_batch(step, r)[1] for r in range(world)])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def zero3_tiled(steps: int) -> dict:
    """The plain model's layers as TiledLinear tiles built under zero.Init and filled by
    copy_params_from (a collective there), trained at ZeRO 3: the batch-mean loss."""
    import deepspeed
    from deepspeed_ext import comm

    plain = _plain()
    with deepspeed.zero.Init():
        model = torch.nn.Sequential(
            deepspeed.zero.TiledLinear(12, 20, in_splits=2, out_splits=3),
            torch.nn.GELU(),
            deepspeed.zero.TiledLinear(20, 3, in_splits=4, out_splits=1),
        )
    model[0].copy_params_from(plain[0])
    model[2].copy_params_from(plain[2])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    tiles = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    losses = []
    for step in range(steps):
        x, y = _batch(step, comm.get_rank())
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        comm.all_reduce(t)
        losses.append(float(t) / comm.get_world_size())
    engine.destroy()
    return {"losses": losses, "tiles": tiles}
