"""Keys the runtime honours, each against what upstream documents for it: the gradient
averaging keys against a single-process reference, bf16.check_grad_overflow, the checkpoint
tag check, dataloader_drop_last, log_level, dump_state, vocabulary_size, timers.throughput,
zero_optimization.leaf_module and override_module_apply, fp16.min_loss_scale as a float."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from deepspeed_ext.config import parse
from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import mean_grads

from . import honoured_runs as hr


def _reference_delta(op: str) -> dict[str, torch.Tensor]:
    """One SGD step on the two ranks' batches: the mean (or sum) of their gradients."""
    scale = 2.0 if op == "sum" else 1.0
    return {n: -hr.LR * scale * g for n, g in mean_grads(2).items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    tmp = str(tmp_path_factory.mktemp("tags"))
    return [
        run_ranks(hr.averaging, 2, timeout=300),
        run_ranks(hr.tags_and_loader, 2, tmp, timeout=120),
    ]


@pytest.fixture(scope="module")
def one_rank() -> dict[str, Any]:
    return run_ranks(hr.single_rank, 1, timeout=180)[0]


# gradient_allreduce_op "sum" is refused with stage 3 (upstream's rule)
CASES = [(s, op) for s in (0, 1, 2, 3) for op in hr.AVERAGING if (s, op) != (3, "sum")]


@pytest.mark.parametrize(("stage", "op"), CASES)
def test_gradient_averaging_keys_match_the_reference(two_ranks: list[Any], stage: int, op: str):
    want = _reference_delta("sum" if op == "sum" else "mean")
    for rank_out in two_ranks[0]:
        got = rank_out[f"{stage}/{op}"]
        for n, delta in want.items():
            torch.testing.assert_close(got[n], delta, rtol=1e-5, atol=1e-7, msg=n)


def test_sum_is_twice_the_mean_on_two_ranks(two_ranks: list[Any]):
    out = two_ranks[0][0]
    for n, mean in out["1/mean"].items():
        torch.testing.assert_close(out["1/sum"][n], 2 * mean)


def test_tag_validation_fails_warns_or_ignores_differing_tags(two_ranks: list[Any]):
    for out in two_ranks[1]:
        assert "the ranks passed 2 different tags (tag0, tag1)" in out["fail"]
        assert out["warn"] == "saved" and out["ignore"] == "saved"


def test_dataloader_drop_last(two_ranks: list[Any]):
    # 18 samples over 2 ranks: 9 each, in micro-batches of 4
    for out in two_ranks[1]:
        assert out["batches drop_last=False"] == 3
        assert out["batches drop_last=True"] == 2


def test_bf16_check_grad_overflow_skips_or_steps(one_rank: dict[str, Any]):
    assert one_rank["overflow check=True"] == (1, True)
    assert one_rank["overflow check=False"] == (0, False)


def test_log_level_dump_state_vocabulary_and_throughput(one_rank: dict[str, Any]):
    assert one_rank["log level"] == logging.DEBUG
    log = "\n".join(one_rank["log"])
    assert "engine state:" in log and '"zero_stage": 0' in log
    assert "vocabulary_size 50257 is not a multiple of 8" in log
    assert "samples_per_s" not in one_rank["metrics"] and "lr" in one_rank["metrics"]
    assert isinstance(one_rank["bucket"], int) and one_rank["bucket"] > 0


def test_leaf_modules_from_the_config_and_module_apply(one_rank: dict[str, Any]):
    assert one_rank["leaves"] == ["2", "4"]
    assert one_rank["apply patched"] == {True: True, False: False}


def test_param_types_kept_whole_by_stage_3(one_rank: dict[str, Any]):
    for built in ("engine", "zero.Init"):
        assert one_rank[f"whole force {built}"] == ["1.weight", "1.bias"]
        assert one_rank[f"whole allow {built}"] == ["1.weight", "1.bias"]


def test_fp16_override_modules_compute_in_fp32_at_stages_0_and_3():
    out = run_ranks(hr.fp32_modules, 1, timeout=120)[0]
    for stage in (0, 3):
        assert out[stage] == {
            "seen": ("torch.float32", "torch.float32"),  # inputs and own params cast up
            "out": "torch.float16",  # the rest of the model gets its dtype back
            "stored": "torch.float16",  # one storage dtype for every ZeRO layout
            "moved": True,  # gradients reached the 16-bit parameter through the cast
        }, stage


def test_fp16_override_modules_needs_a_16_bit_model():
    with pytest.raises(Exception, match="fp16_override_modules keeps modules in fp32"):
        parse({"fp16_override_modules": ["LayerNorm"]})


def test_min_loss_scale_may_be_a_float_floor():
    from deepspeed_ext.runtime.precision import make_loss_scaler

    cfg = parse({"fp16": {"enabled": True, "min_loss_scale": 1e-5, "initial_scale_power": 0}})
    scaler = make_loss_scaler(cfg.fp16)
    for _ in range(60):  # halving from 1 (with hysteresis) until the floor holds it
        if scaler.loss_scale <= 1e-5:
            break
        scaler.update(True)
    assert scaler.loss_scale == pytest.approx(1e-5)  # 2**-17 would be below it


def test_pt_model_wrapper_returns_a_training_engine(one_rank: dict[str, Any]):
    assert one_rank["pt_model"] == ("DeepSpeedEngine", 1)


def test_client_optimizer_and_scheduler_replacing_the_config_sections_is_said(one_rank):
    name, lines = one_rank["client overrides"]
    assert name == "SGD"
    said = " ".join(lines)
    assert 'optimizer section (type "Adam") is not used' in said
    assert 'scheduler section (type "WarmupLR") is not used' in said
