"""The `torch_autocast` section ([Note: torch_autocast]): an fp32 model whose forward runs
under torch.autocast, equal to torch's own autocast training (with torch's GradScaler in
fp16), on one and two ranks, at ZeRO 0-3 and in a pipeline stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import batch, mlp

STEPS = 4
LR = 1e-2


def _config(dtype: str, stage: int = 0) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "torch_autocast": {"enabled": True, "dtype": dtype},
        "zero_optimization": {"stage": stage},
    }


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def _train(dtype: str, stage: int, overflow_at: int | None) -> dict[str, Any]:
    """The engine's run; at `overflow_at` the batch is large enough to overflow fp16."""
    import deepspeed
    from deepspeed_ext import comm

    comm.init_distributed()
    rank = comm.get_rank()
    engine, *_ = deepspeed.initialize(model=mlp(), config=_config(dtype, stage))
    seen: list[torch.dtype] = []
    engine.module[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    for step in range(STEPS):
        x, y = batch(step, rank)
        if step == overflow_at:
            x = x * 1e5
        engine.backward(_loss(engine, x, y))
        engine.step()
    return {
        "state": {n: t.detach().clone() for n, t in engine.module.state_dict().items()},
        "param_dtypes": {p.dtype for p in engine.module.parameters()},
        "forward_dtypes": set(seen),
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scaler.loss_scale if engine.loss_scaler else None,
    }


def _reference(dtype: torch.dtype, world: int, overflow_at: int | None) -> dict[str, Any]:
    """torch alone: autocast forwards of every rank's batch, the mean loss, torch's
    GradScaler in fp16, Adam."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(world):
            x, y = batch(step, r)
            if step == overflow_at:
                x = x * 1e5
            with torch.autocast("cpu", dtype=dtype):
                loss = _loss(model, x, y) / world
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return {
        "state": {n: t.detach().clone() for n, t in model.state_dict().items()},
        "scale": scaler.get_scale() if scaler.is_enabled() else None,
    }


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_autocast_on_two_ranks_equals_torch_autocast(stage: int) -> None:
    outs = run_ranks(_train, 2, "bf16", stage, None, timeout=180)
    ref = _reference(torch.bfloat16, 2, None)
    for out in outs:
        assert out["param_dtypes"] == {torch.float32}  # the model is not cast
        assert out["forward_dtypes"] == {torch.bfloat16}  # its Linear ran in bf16
        for n, t in ref["state"].items():
            torch.testing.assert_close(out["state"][n], t, rtol=1e-5, atol=1e-6, msg=n)


def test_fp16_autocast_skips_an_overflowing_step_as_torchs_grad_scaler() -> None:
    (out,) = run_ranks(_train, 1, "fp16", 0, 1, timeout=120)
    ref = _reference(torch.float16, 1, 1)
    assert out["forward_dtypes"] == {torch.float16}
    assert out["skipped"] == 1
    assert out["scale"] == ref["scale"] == 2.0**15  # halved once, as GradScaler
    for n, t in ref["state"].items():
        torch.testing.assert_close(out["state"][n], t, rtol=1e-5, atol=1e-6, msg=n)


def _pipeline_forward_dtypes() -> set[torch.dtype]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)]
    module = PipelineModule(layers, num_stages=2, loss_fn=nn.functional.mse_loss)
    config = {**_config("bf16"), "train_micro_batch_size_per_gpu": 4}
    config["gradient_accumulation_steps"] = 2
    engine, *_ = deepspeed.initialize(model=module, config=config)
    seen: set[torch.dtype] = set()
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    data = iter([batch(s, 0, size=4) for s in range(2)])
    engine.train_batch(data_iter=data)
    return seen


def test_a_pipeline_stage_runs_its_forward_under_autocast() -> None:
    for seen in run_ranks(_pipeline_forward_dtypes, 2, timeout=120):
        assert seen == {torch.bfloat16}


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"bf16": {"enabled": True}}, ["torch_autocast.enabled and bf16.enabled"]),
        ({"fp16": {"enabled": True}}, ["torch_autocast.enabled and fp16.enabled"]),
        (
            {
                "torch_autocast": {
                    "enabled": True,
                    "lower_precision_safe_modules": ["torch.nn.Linear"],
                }
            },
            ["torch_autocast.lower_precision_safe_modules", "communication_data_type"],
        ),
        ({"torch_autocast": {"enabled": True, "dtype": "fp32"}}, ['torch_autocast.dtype "fp32"']),
    ],
)
def test_what_torch_autocast_does_not_combine_with_is_named(
    extra: dict[str, Any], words: list[str]
) -> None:
    from deepspeed_ext.config import parse

    config = {"train_batch_size": 8, "torch_autocast": {"enabled": True}, **extra}
    with pytest.raises(Exception) as err:
        parse(config)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_fp16_autocast_with_gradient_compression_is_refused_once_the_dtype_is_known() -> None:
    from deepspeed_ext.config import parse
    from deepspeed_ext.runtime.precision import autocast

    config = parse(
        {
            "train_batch_size": 8,
            "torch_autocast": {"enabled": True},  # unset: fp16 on CUDA, bf16 on the host
            "gradient_compression": {"algorithm": "1bit"},
        }
    )
    autocast.check(config, autocast.autocast_dtype(config.torch_autocast, "cpu"))  # bf16: fine
    with pytest.raises(ValueError, match="gradient_compression does not work with torch_autocast"):
        autocast.check(config, autocast.autocast_dtype(config.torch_autocast, "cuda"))


def test_the_fp16_loss_scale_halves_below_one_as_grad_scalers_does() -> None:
    from deepspeed_ext.runtime.precision import LossScaleError, autocast

    scaler = autocast.loss_scaler()
    for _ in range(17):  # 2**16 halved 17 times (GradScaler has no floor)
        scaler.update(True)
    assert scaler.loss_scale == 0.5
    scaler.cur_scale = scaler.min_scale
    with pytest.raises(LossScaleError, match='torch_autocast.dtype "bf16"'):
        scaler.update(True)
