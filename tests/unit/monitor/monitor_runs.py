"""Rank body for test_monitors.py: a short run with every monitor on."""

from __future__ import annotations

import os
from typing import Any

import torch


def train_with_every_monitor(out: str) -> dict[str, Any]:
    from deepspeed_ext.runtime.initialize import initialize

    os.environ.update(
        WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true", COMET_OFFLINE_DIRECTORY=out
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, *_ = initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "jsonl_monitor": {"enabled": True, "output_path": out, "job_name": "j"},
            "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
            "wandb": {"enabled": True, "project": "proj", "group": "grp"},
            "comet": {
                "enabled": True,
                "online": False,
                "project": "proj",
                "experiment_name": "exp",
                "samples_log_interval": 8,
            },
        },
    )
    for _ in range(4):
        x = torch.randn(4, 8)
        engine.backward((engine(x) - x.sum(1, keepdim=True)).square().mean())
        engine.step()
    (wandb_writer,) = [w for w in engine.metrics.writers if type(w).__name__ == "WandbWriter"]
    run = wandb_writer.run
    seen = {"summary": dict(run.summary), "project": run.project, "group": run.group}
    engine.destroy()
    return seen


def one_rank_slowed(out_dir: str) -> dict[str, Any]:
    """3 ranks training with jsonl_monitor and slow-node checks; rank 1 computes 40 ms longer
    each step. Every rank's wall time is the slow one's (they wait for it); its compute time
    is not. Returns each rank's records, the ranks each check found slow, the metrics' slow
    figures and the slow-node warnings logged."""
    import json
    import logging
    import time
    from pathlib import Path

    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.utils.logging import logger
    from tests.unit.runtime.models import batch, loss_fn, mlp

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("slow node"):
                warnings.append(record.getMessage())

    logger.addHandler(Keep())
    engine, *_ = initialize(
        model=mlp(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "steps_per_print": 4,
            "jsonl_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
            "communication": {"slow_node_tolerance": 0.5, "slow_node_interval": 4},
        },
    )
    slow, figures = [], []
    for s in range(16):
        x, y = batch(s, engine.dp_rank)
        loss = loss_fn(engine, x, y)
        if engine.dp_rank == 1:
            time.sleep(0.04)
        engine.backward(loss)
        engine.step()
        if engine.global_steps % 4 == 0:
            slow.append(list(engine.slow_nodes.slow))
            figures.append({k: v for k, v in engine.metrics.last.items() if "slow" in k})
    engine.destroy()
    path = Path(out_dir) / "job" / "ranks" / f"rank{engine.dp_rank}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {"records": records, "slow": slow, "figures": figures, "warnings": warnings}
