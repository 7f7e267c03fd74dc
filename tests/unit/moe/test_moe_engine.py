"""MoE layers with experts spread over ranks, trained by the engine (real gloo ranks), equal
a single-process run of the same model with every expert local: the all-to-all both ways,
the expert gradients summed over their copies and scaled by the data-parallel size, the
norm for clipping over every expert once, and the copies started alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks

from . import moe_runs


def _check(outs: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for out in outs:
        want = moe_runs.local_experts(ref["state"], out["ep_rank"], out["local"])
        assert out["state"].keys() == want.keys()
        for n, t in want.items():
            torch.testing.assert_close(out["state"][n], t, rtol=1e-4, atol=1e-5, msg=n)
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_two_ranks_each_holding_half_the_experts_match_one_process(k: int) -> None:
    outs = run_ranks(moe_runs.train, 2, 2, k, False, timeout=180)
    _check(outs, moe_runs.reference(2, k))


def test_four_ranks_two_copies_of_each_expert_match_one_process() -> None:
    """ep_size 2 on 4 ranks: each expert on 2 ranks (its expert-data group); the second
    copies start spoiled, so the engine must start them from the first."""
    outs = run_ranks(moe_runs.train, 4, 2, 2, True, timeout=240)
    _check(outs, moe_runs.reference(4, 2))


@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 1},
        {"stage": 2},
        {  # the host's optimizer, all-reduced buckets, updates gathered in pieces
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "reduce_scatter": False,
            "allgather_bucket_size": 50,
        },
    ],
    ids=["stage1", "stage2", "stage2-offload"],
)
def test_zero_partitions_each_expert_over_its_copies_and_matches_one_process(
    zero: dict[str, Any],
) -> None:
    """[Note: ZeRO with spread experts]: 4 ranks, ep_size 2, so each expert's state is
    partitioned over its 2 copies (the second spoiled before initialize)."""
    outs = run_ranks(moe_runs.train, 4, 2, 2, True, zero, timeout=240)
    _check(outs, moe_runs.reference(4, 2))


def test_expert_groups_for_code_written_for_upstream() -> None:
    for out in run_ranks(moe_runs.accessors_after_another_engine, 2, timeout=120):
        assert out["size"] == 2  # still answered after another engine's initialize
        assert out["capacity"] == 6  # agreed over upstream's process group: both ranks' max
        assert "use_data_before_expert_parallelism=False" in out["order"], out
        assert "enable_backward_allreduce=False" in out["local"], out
        assert "OnebitAdam" in out["onebit"] and "ep_size 2" in out["onebit"], out
        assert "OnebitAdam" in out["onebit_config"] and "ep_size 2" in out["onebit_config"]


def test_what_spread_experts_do_not_run_with_yet_is_refused_by_name() -> None:
    outs = run_ranks(moe_runs.refused, 2, 3, timeout=120)
    assert all("zero_optimization.stage 3" in o and "ep_size=1" in o for o in outs), outs


def _whole(outs: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    """Every rank's globally named tensors in one dict (copies agree: checked)."""
    whole: dict[str, torch.Tensor] = {}
    for out in outs:
        for n, t in out[key].items():
            if n in whole:
                torch.testing.assert_close(t, whole[n], msg=f"{key}: copies of {n} differ")
            whole[n] = t
    return whole


@pytest.mark.parametrize(
    ("world", "ep_save", "ep_load", "precision", "stages"),
    [
        (2, 2, 1, "fp32", (0, 0)),
        (2, 1, 2, "fp32", (0, 0)),
        (2, 2, 2, "bf16", (0, 0)),
        (2, 2, 2, "fp16", (0, 0)),
        # [Note: ZeRO with spread experts]: each expert partitioned over 2 copies
        (4, 2, 2, "fp32", (2, 2)),
        (4, 2, 1, "fp32", (1, 2)),  # into ZeRO with every expert local
        (4, 2, 2, "fp16", (1, 2)),
        (4, 4, 2, "fp32", (2, 0)),  # from ZeRO to stage 0
        (2, 2, 2, "fp32", (0, 1)),  # from stage 0 to ZeRO
    ],
)
def test_checkpoints_resume_at_another_ep_size_and_consolidate(
    tmp_path, world: int, ep_save: int, ep_load: int, precision: str, stages: tuple[int, int]
) -> None:
    """fp16 with a small initial loss scale: the scaler's state resumes too."""
    args = (ep_save, ep_load, 2, precision, str(tmp_path), *stages)
    outs = run_ranks(moe_runs.resume, world, *args, timeout=240)
    at_save = _whole(outs, "at_save")
    assert len(at_save) == len(moe_runs.whole(2).state_dict())  # every expert, once
    loaded = _whole(outs, "loaded")
    for n, t in at_save.items():
        torch.testing.assert_close(loaded[n], t, rtol=0, atol=0, msg=n)
    uninterrupted, resumed = _whole(outs, "uninterrupted"), _whole(outs, "resumed")
    for n, t in uninterrupted.items():  # the optimizer state came back too
        torch.testing.assert_close(resumed[n], t, rtol=1e-5, atol=1e-6, msg=n)
    if precision == "fp32":  # and both are the one-process run's
        ref = moe_runs.reference(world, 2)["state"]
        for n, t in ref.items():
            torch.testing.assert_close(resumed[n], t, rtol=1e-4, atol=1e-5, msg=n)
    masters = _whole(outs, "masters")  # zero_to_fp32 gives the fp32 masters, 16-bit the weights
    fp32, w16 = outs[0]["fp32"], outs[0]["16bit"]
    assert fp32.keys() == w16.keys() == at_save.keys() == masters.keys()
    for n, t in masters.items():
        torch.testing.assert_close(fp32[n], t, rtol=0, atol=0, msg=n)
        torch.testing.assert_close(w16[n], at_save[n], rtol=0, atol=0, msg=n)
    if precision == "fp32":
        for n, t in moe_runs.reference(world, 2, steps=2)["state"].items():
            torch.testing.assert_close(fp32[n], t, rtol=1e-4, atol=1e-5, msg=n)


def test_zero_resumes_with_experts_frozen_on_some_ranks_and_two_param_groups(tmp_path) -> None:
    """Ranks without expert groups keep the dense groups at the same optimizer places, so
    the rank files are read alike (was KeyError, or another group's moments)."""
    outs = run_ranks(moe_runs.resume_partly_frozen, 4, str(tmp_path), timeout=240)
    ref = moe_runs.reference_partly_frozen()
    uninterrupted, resumed = _whole(outs, "uninterrupted"), _whole(outs, "resumed")
    for n, t in ref.items():
        torch.testing.assert_close(uninterrupted[n], t, rtol=1e-4, atol=1e-5, msg=n)
        torch.testing.assert_close(resumed[n], uninterrupted[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_group_keeps_one_set_of_options_on_every_rank_when_experts_change_group(
    tmp_path,
) -> None:
    """An optimizer group holding dense params and (by local index) experts: at another
    ep_size an expert comes from the other group; the dense part's options win on every
    rank (an expert part written last gave ranks other learning rates for the same param)."""
    outs = run_ranks(moe_runs.regrouped_options, 4, str(tmp_path), timeout=240)
    assert all(o == outs[0] for o in outs), outs
    assert outs[0] == [(2e-2, (0.9, 0.999)), (1e-2, (0.8, 0.99))], outs[0]


def test_copies_of_an_expert_frozen_differently_are_refused_on_every_rank() -> None:
    """(They hung: the trained copy's bucket waited for the frozen one.)"""
    outs = run_ranks(moe_runs.mismatched_freeze, 4, timeout=120)
    assert all("freeze different parameters" in o for o in outs), outs
    assert "MoE layer(s) [0]" in outs[1] and "another rank's" in outs[0], outs


def test_frozen_experts_on_other_ranks_are_left_out_when_asked(tmp_path) -> None:
    out = run_ranks(moe_runs.frozen_export, 2, str(tmp_path), timeout=120)[0]
    expert = "moe.deepspeed_moe.experts.deepspeed_experts."
    for kind in ("16bit", "fp32"):
        kept = {n[len(expert) :].split(".")[0] for n in out[kind] if n.startswith(expert)}
        assert kept == {"0", "1", "2"}, (kind, out[kind])  # 3 was frozen on rank 1
        assert "inp.weight" in out[kind]
