"""0/1 Adam ([Note: 0/1 Adam]) on real gloo ranks: torch's AdamW bit for bit while every step
updates the variance, the schedule of full-precision steps and of synchronisations as the
paper's, one model on every rank at each synchronisation (their own in between), and a
resume between two synchronisations that continues bit for bit on every rank. Its loss
against Adam's: test_onebit_adam.py::test_a_tiny_gpt_learns_as_with_adam."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deepspeed_ext.config import ConfigError, parse
from deepspeed_ext.runtime.onebit.zoadam import ZeroOneAdam
from tests.helpers.distributed import run_ranks

from . import onebit_runs as runs
from .parity import same_steps


def test_variance_steps_are_torch_adamw_bit_for_bit_alone() -> None:
    same_steps(
        lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, foreach=False),
        lambda ps: ZeroOneAdam(ps, lr=3e-3, weight_decay=0.1, var_update_scaler=100),
    )


def test_the_schedule_and_one_model_at_every_synchronisation() -> None:
    r0, r1 = run_ranks(runs.zero_one_schedule, 2, timeout=240)
    for n in r0["adam"]:
        assert torch.equal(r0["warm"][n], r0["adam"][n]), n  # every step a variance step
    # var_update_scaler 2: variance steps 1, 2 (interval 1), 4, 6 (interval 2), 8 (interval
    # 4); var_freeze_step 8; the steps between get each rank's own gradient
    full = [True, True, False, True, False, True, False, True] + [False] * 8
    assert r0["allreduce"] == r1["allreduce"] == full
    # local_step_scaler 2, clipper 4: syncs at steps 9, 10 (interval 1), 12 (2), 16 (4);
    # in between each rank steps on its own gradient
    same = [True] * 10 + [False, True, False, False, False, True]
    assert r0["same"] == same
    for t, names in enumerate(r0["rows"], start=1):
        compressed = "all_to_all_single" in names
        # a 1-bit exchange on each compressed variance step and at each sync, never between
        assert compressed == (t <= 8 and not full[t - 1] or t > 8 and same[t - 1]), (t, names)
    for r in (r0, r1):  # the lr decayed to 0: synchronisations go on, one model after them
        assert r["lr_zero"]["same"]
        assert all(math.isfinite(x) for x in r["lr_zero"]["losses"])


def test_a_resume_between_synchronisations_continues_bit_for_bit(tmp_path: Path) -> None:
    for r in run_ranks(runs.zero_one_resume, 2, str(tmp_path), timeout=240):
        for n in r["straight"]:
            assert torch.equal(r["resumed"][n], r["straight"][n]), n


def test_bad_values_name_the_parameter() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization.stage 0 only .*it is 1"):
        parse({"optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": {"stage": 1}})
    params = list(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="var_update_scaler=0 must be >= 1"):
        ZeroOneAdam(params, var_update_scaler=0)
    with pytest.raises(ValueError, match="var_freeze_step=0 must be >= 1"):
        ZeroOneAdam(params, var_freeze_step=0)  # the frozen denominator would be eps alone
    with pytest.raises(ValueError, match="cuda_aware=True is an MPI option"):
        ZeroOneAdam(params, cuda_aware=True)
    with pytest.raises(ValueError, match="max_grad_norm is not used"):
        ZeroOneAdam(params, max_grad_norm=1.0)
