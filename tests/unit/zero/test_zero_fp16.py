"""fp16 with ZeRO: an overflow on one rank's gradients skips the step on every rank."""

import os

import pytest
import torch

from tests.helpers.distributed import run_ranks


def _run(stage: int) -> dict:
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.runtime.models import batch, loss_fn
    from tests.unit.zero.zero_runs import Net

    rank = int(os.environ["RANK"])
    engine, *_ = initialize(
        model=Net(),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
        },
    )
    unchanged = None
    for s in range(4):
        x, y = batch(s, rank, size=4)
        loss = loss_fn(engine, x, y)
        if s == 2 and rank == 1:  # only rank 1 overflows
            loss = loss * float("inf")
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(loss)
        engine.step()
        if s == 2:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    return {
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scaler.loss_scale if engine.loss_scaler else 1.0,
        "unchanged": unchanged,
        "params": [p.detach().float().clone() for p in engine.module.parameters()],
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_overflow_skips_everywhere(stage):
    a, b = run_ranks(_run, 2, stage)
    for r in (a, b):
        assert r["skipped"] == 1 and r["unchanged"] and r["scale"] == 512.0, r
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
