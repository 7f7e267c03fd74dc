"""fp16.auto_cast (a forward's positional floating-point inputs cast to fp16, as upstream's)
and zero_optimization.load_from_fp32_weights (false: a resume takes the fp32 masters from the
16-bit weights instead of the checkpoint's fp32 copy)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import batch, mlp


class _Scaled(nn.Module):
    """An mlp whose forward also takes a keyword tensor (which auto_cast leaves alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, scale.dtype))
        return self.net(x) * scale.to(x.dtype)


def _fp16_run(auto_cast: bool, pipeline: bool = False) -> dict[str, Any]:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "fp16": {"enabled": True, "auto_cast": auto_cast, "initial_scale_power": 8},
    }
    if pipeline:
        from deepspeed.pipe import PipelineModule

        torch.manual_seed(0)
        layers = [nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)]
        seen: list[torch.dtype] = []
        layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        module = PipelineModule(
            layers, num_stages=2, loss_fn=lambda o, y: nn.functional.mse_loss(o.float(), y)
        )
        engine, *_ = deepspeed.initialize(
            model=module, config={**config, "gradient_accumulation_steps": 2}
        )
        engine.train_batch(data_iter=iter([batch(s, 0) for s in range(2)]))
        return {"seen": seen}
    model = _Scaled()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    for step in range(3):
        x, y = batch(step, 0)
        if not auto_cast:
            x = x.half()  # what auto_cast does for the user
        out = engine(x, scale=torch.full((1,), 0.5))
        engine.backward(nn.functional.mse_loss(out.float(), y))
        engine.step()
    state = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    return {"state": state, "seen": model.seen}


def test_fp16_auto_cast_casts_positional_inputs_as_a_user_would() -> None:
    cast, by_hand = run_ranks(_fp16_run, 1, True)[0], run_ranks(_fp16_run, 1, False)[0]
    assert set(cast["seen"]) == {(torch.float16, torch.float32)}  # keywords as given
    for n, t in by_hand["state"].items():
        assert torch.equal(cast["state"][n], t), n


def test_fp16_auto_cast_casts_a_pipeline_stages_inputs() -> None:
    outs = run_ranks(_fp16_run, 2, True, True, timeout=120)
    assert outs[0]["seen"] == [torch.float16, torch.float16]  # the first stage's 2 micro-batches


def test_fp16_auto_cast_without_fp16_is_refused() -> None:
    from deepspeed_ext.config import parse

    with pytest.raises(Exception, match="fp16.auto_cast casts"):
        parse({"train_batch_size": 8, "fp16": {"enabled": False, "auto_cast": True}})


def _masters_after_resume(where: str, from_fp32: bool) -> list[bool]:
    """bf16 at ZeRO 2: after a resume, is each fp32 master exactly its bf16 weight?"""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed_ext import comm

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "load_from_fp32_weights": from_fp32},
    }
    engine, *_ = deepspeed.initialize(model=mlp(), config=config)
    for step in range(2):
        x, y = batch(step, comm.get_rank())
        out = engine(x.to(torch.bfloat16))
        engine.backward(nn.functional.mse_loss(out.float(), y))
        engine.step()
    engine.save_checkpoint(where, tag="t")
    fresh, *_ = deepspeed.initialize(model=mlp(seed=1), config=config)
    fresh.load_checkpoint(where, tag="t")
    return [
        torch.equal(safe_get_full_fp32_param(p), p.detach().float())
        for p in fresh.module.parameters()
    ]


@pytest.mark.parametrize("from_fp32", [True, False])
def test_load_from_fp32_weights_picks_where_the_masters_come_from(tmp_path, from_fp32) -> None:
    exact = run_ranks(_masters_after_resume, 2, str(tmp_path), from_fp32, timeout=120)[0]
    if from_fp32:  # the checkpoint's fp32 masters carry bits the bf16 weights lost
        assert not all(exact), exact
    else:
        assert all(exact), exact


def test_cast_half_reaches_nested_inputs_and_keeps_their_types() -> None:
    import collections

    from deepspeed_ext.runtime.precision import cast_half

    ids = torch.ones(2, dtype=torch.int64)
    out = cast_half((collections.OrderedDict(x=torch.ones(2), ids=ids), [torch.ones(1)], 3.0))
    assert type(out[0]) is collections.OrderedDict
    assert out[0]["x"].dtype == torch.float16 and out[0]["ids"] is ids
    assert out[1][0].dtype == torch.float16 and out[2] == 3.0
