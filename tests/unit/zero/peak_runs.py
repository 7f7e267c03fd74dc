"""Per-rank peak memory of one model under each ZeRO stage (importable by spawned ranks)."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

# stage 3 partitioned: nothing kept gathered past its module, about one layer prefetched
PARTITIONED = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 1_100_000,
    "stage3_max_live_parameters": 2_200_000,
}


def peaks(stages: list[int], layers: int = 16, width: int = 1024, steps: int = 6) -> dict:
    """For each stage: the largest per-phase peak (memory_breakdown) over steps 3.., MB."""
    from deepspeed_ext.runtime.initialize import initialize

    out: dict[int, Any] = {}
    for stage in stages:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        cfg = {
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage, **(PARTITIONED if stage == 3 else {})},
            "memory_breakdown": True,
            "steps_per_print": 1,
        }
        engine, *_ = initialize(model=model, config=cfg)
        worst = 0.0
        for step in range(steps):
            loss = engine(torch.randn(8, width)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            if step >= 2:
                worst = max(
                    worst, *(v for k, v in engine.metrics.last.items() if k.endswith("_peak_mb"))
                )
        out[stage] = worst
        engine.destroy()
        del engine, model, loss
        gc.collect()
    return out
