"""1-bit Adam ([Note: 1-bit Adam]) on real gloo ranks: torch's AdamW bit for bit during the
warm-up, one model on every rank after it, a tiny GPT's loss close to Adam's, and a resume
that continues exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deepspeed_ext.config import ConfigError, parse
from deepspeed_ext.runtime.onebit.adam import OnebitAdam
from deepspeed_ext.runtime.onebit.zoadam import ZeroOneAdam
from tests.helpers.distributed import run_ranks

from . import onebit_runs as runs
from .parity import same_steps


def test_the_warm_up_is_torch_adamw_bit_for_bit_alone() -> None:
    same_steps(
        lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, foreach=False),
        lambda ps: OnebitAdam(ps, lr=3e-3, weight_decay=0.1, freeze_step=10),
    )


def test_engine_warm_up_equals_adam_and_compression_keeps_ranks_identical() -> None:
    r0, r1 = run_ranks(runs.warmup_then_compression, 2, timeout=180)
    for r in (r0, r1):
        for n in r["adam"]:
            assert torch.equal(r["warm"][n], r["adam"][n]), n  # freeze_step not reached
        assert r["switched_at_freeze"]  # the gradient all-reduce stopped after step 3
        # after the switch: the momentum's all-to-all and all-gather, and no gradient
        # all-reduce: only the norm's one number (each rank's gradients are its own)
        assert "all_to_all_single" in r["names"], r["names"]
        assert max(r["names"].get("all_reduce", [0])) <= 8, r["names"]
    for n in r0["bit"]:
        assert torch.equal(r0["bit"][n], r1["bit"][n]), n  # one model on every rank
        assert not torch.equal(r0["bit"][n], r0["adam"][n])


def test_a_resume_past_the_freeze_continues_bit_for_bit(tmp_path: Path) -> None:
    for r in run_ranks(runs.resume, 2, str(tmp_path), timeout=180):
        assert r["after_load"] is False  # resumed into the compression stage
        for n in r["straight"]:
            assert torch.equal(r["resumed"][n], r["straight"][n]), n
    # each rank's error-feedback buffers went to its own file
    files = sorted(p.name for p in (tmp_path / "s4").iterdir())
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in files
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in files


def test_a_resume_on_more_ranks_restarts_the_error_buffers(tmp_path: Path) -> None:
    """1 rank saved, 2 resume: the rank without a file of its own starts its error feedback
    at zero (said), as a resume on fewer ranks does, instead of failing the load."""
    run_ranks(runs.save_alone, 1, str(tmp_path), timeout=120)
    r0, r1 = run_ranks(runs.resume_wider, 2, str(tmp_path), timeout=180)
    for name in runs.WIDER:
        assert all(math.isfinite(x) for x in r0[name]["losses"] + r1[name]["losses"]), name
        for n, p in r0[name]["params"].items():
            assert torch.equal(p, r1[name]["params"][n]), (name, n)


def test_a_param_first_used_after_the_warm_up_trains_sanely() -> None:
    """A branch first used after the freeze had a variance of zeros (updates of lr * m / eps:
    weights jumped by 1e4; 1-bit LAMB's trust ratio of 0 never moved it), and, first in
    parameter order, its step count of 1 sent the schedule back to the warm-up. Now its first
    gradient, averaged over the ranks, gives its variance (and LAMB's ratio), and the
    schedule is the one of the same run without the branch."""
    r0, r1 = run_ranks(runs.late_branch, 2, timeout=240)
    for name in runs.LATE:
        late, never = r0[name][5], r0[name][99]
        assert late["flags"] == never["flags"] == r1[name][5]["flags"], name
        assert max(late["moved"][:4]) < 1e-3, name  # weight decay alone (0/1 Adam's)
        assert 5e-4 < late["moved"][4] < 0.1 and max(late["moved"]) < 0.3, (name, late["moved"])
        assert all(math.isfinite(x) and x < 5 for x in late["losses"]), (name, late["losses"])


def test_embedding_rows_unseen_in_the_warm_up_move_by_about_lr() -> None:
    """Rows no token reached before the freeze had a variance of exactly 0; the 1-bit codec
    gives every element a sign, so at the first compressed step they moved by lr * m / eps
    (~1e4), with or without a gradient. Now they take their param's mean variance."""
    r0, _ = run_ranks(runs.unseen_rows, 2, timeout=240)
    for name in runs.LATE:
        moved, losses = r0[name]["moved"], r0[name]["losses"]
        assert max(moved) < 0.3, (name, moved)  # lr 1e-2, 9 steps
        assert all(math.isfinite(x) and x < 5 for x in losses), (name, losses)
    # 1-bit LAMB's fresh variance is filled alike: its factor (frozen over fresh variance,
    # max over elements) saw the unseen ones as unbounded and ramped 10% a step (1.77)
    assert r0["OneBitLamb"]["factor"] < 1.3, r0["OneBitLamb"]


def test_the_schedule_reads_the_params_that_counted_most_steps() -> None:
    """A param with no gradient until after the freeze (frozen, then unfrozen), first in
    order, starts counting at 1: the schedule read from it went back to the warm-up."""
    late, early = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = OnebitAdam([late, early], lr=1e-2, freeze_step=2)
    for step in range(1, 6):
        early.grad = torch.full((3,), 0.5)
        late.grad = torch.full((3,), 0.5) if step >= 4 else None
        opt.step()
        assert opt.compressing == (step >= 2), step
    assert (late - 1).abs().max() < 0.05  # and it moved like a fresh Adam param, not by 1e4


def test_a_pipeline_compresses_within_each_stages_data_parallel_group() -> None:
    outs = run_ranks(runs.pipeline_onebit, 4, timeout=300)
    by_stage: dict[int, list[dict]] = {}
    for o in outs:
        assert o["allreduce"] is False  # compressing after step 2
        by_stage.setdefault(o["stage"], []).append(o)
    assert sorted(by_stage) == [0, 1]
    for replicas in by_stage.values():
        a, b = (r["weights"] for r in replicas)
        for n in a:
            assert torch.equal(a[n], b[n]), n  # the two data-parallel replicas stay one model
    losses = outs[0]["losses"]
    assert losses[-1] < losses[0], losses


def test_a_tiny_gpt_learns_as_with_adam() -> None:
    """1-bit Adam and 0/1 Adam against Adam, 1-bit LAMB against LAMB, on one tiny GPT run
    (one spawn for all)."""
    # a third of the run as warm-up: the variance must settle before it freezes (the paper's
    # point; frozen at step 20 of 120 the run ends 16% behind Adam, at 40 2%, at 60 ahead)
    steps, freeze = 120, 40
    optimizers = {
        "adam": runs.ADAM,
        "onebit": runs.onebit(freeze),
        # every variance update kept, local steps of up to 2 (measured: 1.8% behind Adam)
        "zero_one": runs.zero_one(freeze, 1000, local_step_scaler=10, local_step_clipper=2),
        # upstream's variance thinning (var_update_scaler 16): on a run this short the
        # variance it keeps is weighted to the first steps' large gradients, so it steps
        # shorter (measured: 9.5% behind Adam; 10% without any compression at all)
        "zero_one_thinned": runs.zero_one(freeze, 16, local_step_scaler=10, local_step_clipper=4),
        # measured: 2.3% behind LAMB at lr 1e-2 (11% at 3e-2, where LAMB itself gains most)
        "lamb": runs.LAMB,
        "onebit_lamb": runs.onebit_lamb(freeze),
    }
    losses = run_ranks(runs.tiny_gpt_losses, 2, steps, optimizers, timeout=300)[0]
    adam, bit = losses["adam"], losses["onebit"]
    assert adam[:freeze] == bit[:freeze]  # the warm-up is AdamW's, bit for bit
    assert adam[:16] == losses["zero_one_thinned"][:16]  # 16 variance steps: AdamW's too
    last = {k: sum(v[-20:]) / 20 for k, v in losses.items()}
    assert last["adam"] < 0.75 * adam[0]  # it learned
    # stated tolerances on the mean loss of the last 20 steps against Adam's
    assert losses["lamb"][:freeze] == losses["onebit_lamb"][:freeze]  # LAMB's, bit for bit
    for name, ref, tolerance in (
        ("onebit", "adam", 0.05),
        ("zero_one", "adam", 0.05),
        ("zero_one_thinned", "adam", 0.12),
        ("onebit_lamb", "lamb", 0.05),
    ):
        assert abs(last[name] - last[ref]) / last[ref] < tolerance, (name, last)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization.stage 0 only .*it is 2"):
        parse({"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 2}})
    for kind in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):  # the exchange averages
        with pytest.raises(ConfigError, match=rf"\"sum\" does not apply to .*'{kind}'"):
            parse({"optimizer": {"type": kind}, "gradient_allreduce_op": "sum"})
    with pytest.raises(ValueError, match=r"freeze_step=2.9 must be a whole number"):
        OnebitAdam([torch.nn.Parameter(torch.zeros(2))], freeze_step=2.9)
    with pytest.raises(ValueError, match=r"var_update_scaler=1.5 must be a whole number"):
        ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], var_update_scaler=1.5)
    with pytest.raises(ValueError, match=r"local_step_clipper=0 must be >= 1$"):
        ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], local_step_clipper=0)
    # a client OnebitAdam, which no config check sees: refused when the engine takes it
    (said,) = run_ranks(runs.client_optimizer_under_zero1, 1, timeout=120)
    assert "zero_optimization.stage 0 only" in said and "(it is 1)" in said, said
    with pytest.raises(ValueError, match="cuda_aware=True is an MPI option"):
        OnebitAdam([torch.nn.Parameter(torch.zeros(2))], cuda_aware=True)
    with pytest.raises(ValueError, match="the MPI backend is not built"):
        OnebitAdam([torch.nn.Parameter(torch.zeros(2))], comm_backend_name="mpi")
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        OnebitAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
