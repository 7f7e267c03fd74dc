"""Upstream's engine methods for hand-driven steps (runtime/engine_manual.py), on 2 spawned
ranks: engine.scale(loss).backward() trains exactly as engine.backward(loss) (fp16 loss
scaling and accumulation included, stages 0 and 2); load_module_state_dict makes a fresh
engine continue exactly as the one whose weights it loaded (masters included; stages 1 and 3);
clip_fp32_gradients brings the global gradient norm to gradient_clipping; all_gather_scalar
returns every rank's value; get_type and is_first_weights_partition_group read the config."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks


def _engine(stage: int, extra: dict[str, Any] | None = None) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        **(extra or {}),
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def _batches(engine: Any, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + engine.global_rank)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(n)]


def _loss(engine: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(p for p in engine.module.parameters()).dtype
    return ((engine(x.to(dtype)).float() - y) ** 2).mean()


def _train(engine: Any, batches: list, manual: bool = False) -> list[float]:
    losses = []
    for x, y in batches:
        loss = _loss(engine, x, y)
        if manual:
            engine.scale(loss).backward()
        else:
            engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _scenario() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # SGD: Adam would hide a wrong scale (its update does not change with the gradient's)
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    fp16 = {**sgd, "fp16": {"enabled": True, "initial_scale_power": 8}}
    for stage, extra in ((0, fp16), (2, sgd)):
        a, b = _engine(stage, extra), _engine(stage, extra)
        batches = _batches(a, 6, seed=1)
        want = _train(a, batches)
        got = _train(b, batches, manual=True)
        scale_seen = b.loss_scaler.loss_scale if b.loss_scaler is not None else None
        out[f"scale stage {stage}"] = (got == want, scale_seen)
        a.destroy()
        b.destroy()

    for stage in (1, 3):
        bf16 = {"bf16": {"enabled": True}}
        trained = _engine(stage, bf16)
        _train(trained, _batches(trained, 4, seed=2))
        params = list(trained.module.parameters())
        if stage == 3:
            from deepspeed_ext.zero.stage3.gathered import GatheredParameters

            with GatheredParameters(params):
                sd = {k: v.clone() for k, v in trained.module.state_dict().items()}
        else:
            sd = {k: v.clone() for k, v in trained.module.state_dict().items()}
        fresh = _engine(stage, bf16)
        fresh.load_module_state_dict({"module": sd})
        # the optimizer states differ (fresh has none), so compare a plain SGD-like probe:
        # the loss of the next batch, computed from the loaded weights, before any step
        x, y = _batches(fresh, 1, seed=3)[0]
        with torch.no_grad():
            same_forward = float(_loss(fresh, x, y)) == float(_loss(trained, x, y))
        # and the masters: one step with lr 0 leaves the weights where the load put them
        for group in fresh.optimizer.param_groups:
            group["lr"] = 0.0
        _train(fresh, _batches(fresh, 2, seed=4))
        with torch.no_grad():
            after = float(_loss(fresh, x, y)) == float(_loss(trained, x, y))
        out[f"load stage {stage}"] = (same_forward, after)
        trained.destroy()
        fresh.destroy()

    for stage in (0, 2):
        e = _engine(stage, {"gradient_clipping": 1e-3})
        x, y = _batches(e, 1, seed=5)[0]
        e.backward(_loss(e, x, y) * 100)
        e.step()  # inside the accumulation window: nothing steps
        x, y = _batches(e, 1, seed=6)[0]
        e.backward(_loss(e, x, y) * 100)  # the boundary micro-step: gradients reduced
        before = e.clip_fp32_gradients()
        after = math.sqrt(float(e.strategy.grad_sq_sum()))
        out[f"clip stage {stage}"] = (before, after)
        e.step()
        e.destroy()

    e = _engine(3)
    value = torch.tensor([float(e.global_rank) + 0.5], device=e.device)
    out["gather"] = [float(t) for t in e.all_gather_scalar(value)]
    out["queries"] = (e.get_type(), e.is_first_weights_partition_group())
    e.destroy()
    out["stage 1 partition group"] = _engine(1).is_first_weights_partition_group()
    return out


@pytest.fixture(scope="module")
def res() -> dict[str, Any]:
    return run_ranks(_scenario, 2)[0]


def test_scale_then_backward_trains_as_engine_backward(res):
    same, loss_scale = res["scale stage 0"]
    assert same and loss_scale == 2**8  # fp16: the loss scale was applied (and kept)
    assert res["scale stage 2"][0]


@pytest.mark.parametrize("stage", [1, 3])
def test_load_module_state_dict_loads_weights_and_masters(res, stage):
    same_forward, after_steps = res[f"load stage {stage}"]
    assert same_forward, "the loaded model computes another loss than the one it came from"
    assert after_steps, "a step at lr 0 moved the weights: the masters kept the old values"


@pytest.mark.parametrize("stage", [0, 2])
def test_clip_fp32_gradients_brings_the_norm_to_the_limit(res, stage):
    before, after = res[f"clip stage {stage}"]
    assert before > 1e-3 and after == pytest.approx(1e-3, rel=1e-3)


def test_all_gather_scalar_and_config_queries(res):
    assert res["gather"] == [0.5, 1.5]
    assert res["queries"] == ("AdamW", True)
    assert res["stage 1 partition group"] is False
