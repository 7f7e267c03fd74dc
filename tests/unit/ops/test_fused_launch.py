"""FusedAdam's and FusedLion's CUDA launches pass their arguments in the order the CUDA
ops' schemas declare (read from the bindings' m.def strings), checked without a GPU by a
stand-in op that binds the call to the schema's names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.ops.adam import FusedAdam
from deepspeed_ext.ops.lion import FusedLion

BINDINGS = Path(__file__).resolve().parents[3] / "csrc" / "bindings"


def schema_names(file: str, op: str) -> list[str]:
    text = "".join(re.findall(r'"([^"]*)"', (BINDINGS / file).read_text()))
    args = re.search(rf"{op}\((.*?)\) ->", text)
    assert args, f"{op} schema not found in {file}"
    return [a.strip().split()[-1] for a in args.group(1).split(",")]


class StandIn:
    def __init__(self, file: str, op: str) -> None:
        self.names = schema_names(file, op)
        self.bound: dict[str, Any] = {}
        setattr(self, op, self._call)

    def _call(self, *args: Any) -> None:
        assert len(args) == len(self.names), (args, self.names)
        self.bound = dict(zip(self.names, args))


def _lists(keys: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
    return {k: [torch.zeros(3)] for k in ("p", "g", *keys)}


def test_fused_adam_cuda_launch_follows_the_schema():
    opt = FusedAdam(
        [torch.nn.Parameter(torch.zeros(3))], lr=0.5, eps=1e-6, weight_decay=0.2, adam_w_mode=False
    )
    group = {**opt.param_groups[0], "step": 7}
    op = StandIn("fused_adam.cpp", "multi_tensor_adam")
    lists = _lists(FusedAdam.STATE_KEYS)
    opt._launch(op, torch.device("cuda"), group, lists)
    b = op.bound
    assert b["params"] is lists["p"] and b["exp_avg_sqs"] is lists["exp_avg_sq"]
    assert (b["lr"], b["eps"], b["step"], b["weight_decay"]) == (0.5, 1e-6, 7, 0.2)
    assert (b["beta1"], b["beta2"], b["adam_w_mode"], b["bias_correction"]) == (
        0.9,
        0.999,
        False,
        True,
    )


def test_fused_lion_cuda_launch_follows_the_schema():
    opt = FusedLion(
        [torch.nn.Parameter(torch.zeros(3))], lr=0.5, betas=(0.8, 0.7), weight_decay=0.2
    )
    op = StandIn("fused_lion.cpp", "multi_tensor_lion")
    lists = _lists(FusedLion.STATE_KEYS)
    opt._launch(op, torch.device("cuda"), opt.param_groups[0], lists)
    b = op.bound
    assert b["grads"] is lists["g"] and b["exp_avgs"] is lists["exp_avg"]
    assert (b["lr"], b["beta1"], b["beta2"], b["weight_decay"]) == (0.5, 0.8, 0.7, 0.2)
