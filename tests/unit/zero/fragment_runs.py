"""Runs behind test_fragments.py (importable by spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tests.unit.runtime.models import batch, mlp

NAMES = ("2.weight", "4.bias", "0.bias")


def fragments(stage: int, bf16: bool, nvme: str | None = None) -> dict[str, Any]:
    """nvme: a directory for offload_optimizer nvme (stage 3: masters and state swapped)."""
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_set_full_fp32_param,
    )
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import GatheredParameters

    rank = int(os.environ["RANK"])
    model = mlp()
    model.get_submodule("0").weight.requires_grad_(False)  # frozen: no fragments
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 700,  # several buckets: params straddle chunks
            "stage3_param_persistence_threshold": 0,
        },
        "bf16": {"enabled": bf16},
    }
    if nvme is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    engine, *_ = initialize(model=model, config=cfg)
    params = dict(engine.module.named_parameters())
    x, y = batch(0, rank, size=4)
    engine.backward(nn.functional.mse_loss(engine(x.to(params["0.bias"].dtype)).float(), y))
    out: dict[str, Any] = {"frozen": safe_get_full_fp32_param(params["0.weight"])}
    for n in NAMES:
        out[f"grad {n}"] = safe_get_full_grad(params[n])
        out[f"local grad {n}"] = safe_get_local_grad(params[n])
        out[f"param {n}"] = safe_get_full_fp32_param(params[n])
        out[f"local param {n}"] = safe_get_local_fp32_param(params[n])
    engine.step()
    for n in NAMES:
        out[f"exp_avg {n}"] = safe_get_full_optimizer_state(params[n], "exp_avg")
    try:
        safe_get_full_optimizer_state(params["2.weight"], "momentum_buffer")
    except KeyError as e:
        out["no such state"] = str(e)
    new = torch.full((4,), 0.25)
    safe_set_full_fp32_param(params["4.bias"], new)
    out["set param"] = safe_get_full_fp32_param(params["4.bias"])
    with GatheredParameters([params["4.bias"]]):
        out["model param"] = params["4.bias"].detach().float().clone()
    engine.destroy()
    return out
