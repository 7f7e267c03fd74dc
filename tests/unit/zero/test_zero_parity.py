"""ZeRO stages 1 and 2 give the parameters stage 0 gives (which matches torch DDP), on 2 and
4 real gloo ranks, with accumulation, clipping, param groups, frozen and unused params."""

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.unit.zero.zero_runs import train, train_in_comm_dtype, train_with_comm_keys

_refs: dict = {}


def stage0(world: int, *args) -> dict:
    """The stage-0 reference run, computed once per configuration for the module."""
    key = (world, repr(args))
    if key not in _refs:
        _refs[key] = run_ranks(train, world, 0, *args)[0]
    return _refs[key]


def _assert_same(results: list[dict], ref: dict, atol: float, rtol: float) -> None:
    for r in results[1:]:
        for n, p in r["params"].items():
            assert torch.equal(p, results[0]["params"][n]), f"ranks diverged on {n}"
    for n, p in results[0]["params"].items():
        torch.testing.assert_close(
            p, ref["params"][n], atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m}"
        )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_matches_stage0(world, stage):
    ref = stage0(world)
    got = run_ranks(train, world, stage)
    assert ref["grad_norm"] > 0.1, "clipping (0.05) must be engaged for this test to see it"
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)
    # the frozen bias never moved
    torch.testing.assert_close(got[0]["params"]["embed.bias"], ref["params"]["embed.bias"])


SGD_NO_CLIP = {"gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.mark.parametrize("stage", [1, 2])
def test_sgd_without_clipping_matches_stage0(stage):
    """Adam and clipping both hide a wrong gradient scale (e.g. a missing 1/world average);
    plain SGD does not."""
    ref = stage0(2, 4, 2, SGD_NO_CLIP)
    got = run_ranks(train, 2, stage, 4, 2, SGD_NO_CLIP)
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_cpu_offload_matches_stage0(stage):
    ref = stage0(2)
    off = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 500,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        }
    }
    got = run_ranks(train, 2, stage, 4, 2, off)
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)


def test_bf16_stage2_tracks_stage0():
    bf16 = {"bf16": {"enabled": True}}
    ref = stage0(2, 4, 2, bf16)
    got = run_ranks(train, 2, 2, 4, 2, bf16)
    _assert_same(got, ref, atol=1e-2, rtol=1e-2)


def test_optimizer_state_is_partitioned():
    full = run_ranks(train, 2, 0, 1, 1)[0]["state_bytes"]
    parts = [r["state_bytes"] for r in run_ranks(train, 2, 1, 1, 1)]
    # each rank holds about half (plus the padding of its chunks)
    for b in parts:
        assert 0.4 * full < b < 0.65 * full, (b, full)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_communication_keys_change_how_not_what(stage):
    """[Note: ZeRO communication keys]: reduce_scatter false all-reduces the buckets,
    overlap_comm false waits for each, a small allgather_bucket_size gathers the updated
    parameters in pieces (stages 1-2); the parameters are stage 0's all the same."""
    keys = {"reduce_scatter": False, "overlap_comm": False, "allgather_bucket_size": 64}
    got = run_ranks(train_with_comm_keys, 2, stage, keys)
    _assert_same(got, stage0(2), atol=2e-6, rtol=1e-5)
    counts = got[0]["counts"]
    assert counts["all_reduce_bucket"] >= 4, counts  # a bucket or more per step, 4 steps
    if stage < 3:  # 32 elements a rank per gather: several per ~250-element chunk
        assert counts["all_gather"] > 4 * 3, counts
    default = run_ranks(train_with_comm_keys, 2, stage, {})[0]["counts"]
    assert default == {"all_reduce_bucket": 0, "all_gather": 0}, default


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_communication_data_type_reduces_gradients_in_that_dtype(stage):
    """[Note: communication dtype]: bf16 buckets on the wire, fp32 accumulation around them;
    the parameters follow the fp32-reduced run to bf16's rounding (2^-8 of each SGD update),
    and differ from it."""
    got = run_ranks(train_in_comm_dtype, 2, stage, "bf16")
    plain = run_ranks(train_in_comm_dtype, 2, stage, None)[0]
    bucket_elems = sum(p.numel() for p in plain["params"].values())
    # 4 steps, every gradient element reduced once a step (the frozen bias excepted): stage 0
    # all-reduces it, ZeRO sends the other rank its half
    share = 1 if stage == 0 else 0.5
    want = share * 4 * (bucket_elems - 64)
    assert got[0]["reduced"].get("bfloat16", 0) >= want, got[0]["reduced"]
    assert "bfloat16" not in plain["reduced"], plain["reduced"]
    _assert_same(got, plain, atol=1e-4, rtol=1e-3)
    assert any(not torch.equal(p, plain["params"][n]) for n, p in got[0]["params"].items())
