"""Rank bodies for test_engine.py (spawned: importable, module level)."""

from __future__ import annotations

from typing import Any

import torch

from .models import Net


def _train(mode: str, stage: int, steps: int, extra: dict[str, Any]) -> tuple[list, list]:
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        **extra,
    }
    engine, *_ = deepspeed.initialize(model=Net(mode), config=cfg)
    rank = torch.distributed.get_rank()
    losses = []
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, the same per mode
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    from deepspeed.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        final = [p.detach().clone() for p in params]
    return losses, final


def modes_match(stages: list[int]) -> dict[str, Any]:
    """Per ZeRO stage: losses and final parameters of reentrant, non-reentrant and
    CPU-checkpointed runs, and whether each equals the run without checkpointing."""
    from deepspeed_ext.runtime.activation_checkpointing import settings

    out: dict[str, Any] = {}
    for stage in stages:
        ref_losses, ref_final = _train("none", stage, 3, {})
        for mode, extra in [
            ("reentrant", {}),
            ("non_reentrant", {}),
            ("reentrant", {"activation_checkpointing": {"cpu_checkpointing": True}}),
        ]:
            losses, final = _train(mode, stage, 3, extra)
            key = f"{stage}-{mode}-{'cpu' if extra else 'device'}"
            out[key] = {
                "losses_equal": losses == ref_losses,
                "params_equal": all(torch.equal(a, b) for a, b in zip(final, ref_final)),
                "cpu_setting": settings.current().cpu_checkpointing,
            }
    return out
