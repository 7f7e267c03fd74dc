"""zero_optimization.ignore_unused_parameters false (stages 1 and 2, as upstream's): a
trainable parameter that got no gradient in a step stops training by name, on every rank
alike (it may be unused on one rank only: a data-dependent branch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.branch(h) if use_branch else h


def _step(stage: int, ignore: bool) -> str:
    import deepspeed
    from deepspeed_ext import comm

    comm.init_distributed()
    torch.manual_seed(0)
    zero = {"stage": stage, "ignore_unused_parameters": ignore}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
    }
    engine, *_ = deepspeed.initialize(model=_Branchy(), config=config)
    out = engine(torch.randn(2, 4), use_branch=comm.get_rank() == 1)  # rank 0 skips it
    engine.backward(out.pow(2).mean())
    try:
        engine.step()
    except RuntimeError as e:
        return str(e)
    return "stepped"


@pytest.mark.parametrize("stage", [1, 2])
def test_a_param_unused_on_one_rank_stops_every_rank_by_name(stage: int) -> None:
    on_0, on_1 = run_ranks(_step, 2, stage, False)
    assert "['branch.weight', 'branch.bias'] got no gradient on this rank" in on_0, on_0
    assert "got no gradient on another rank" in on_1, on_1
    assert run_ranks(_step, 2, stage, True) == ["stepped", "stepped"]  # the default
